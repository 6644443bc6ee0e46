"""load_llm copies the input embedding out of the weights file's memory map
(pipeline/llm/loader.py, own_embedding): on CPU its bytes lie in no mapping of the file."""

from __future__ import annotations

import os

import torch

from pipeline.llm.loader import llm_folder, load_llm, own_embedding


def _file_ranges(path: str) -> list[tuple[int, int]]:
    ranges = []
    with open(f"/proc/{os.getpid()}/maps") as fh:
        for line in fh:
            if line.rstrip().endswith(path):
                lo, hi = line.split()[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def _tiny_folder(tmp_path, tied: bool):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))
    model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(llm_folder("smollm2"))).save_pretrained(tmp_path)
    return tmp_path, model.get_input_embeddings().weight.detach().clone()


def test_the_embedding_leaves_the_file_map_with_its_values_and_its_tie(tmp_path):
    folder, want = _tiny_folder(tmp_path, tied=True)
    from transformers import AutoModelForCausalLM

    mapped = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    path = os.path.realpath(folder / "model.safetensors")
    emb = mapped.get_input_embeddings().weight
    assert any(lo <= emb.data_ptr() < hi for lo, hi in _file_ranges(path))  # what transformers hands over
    own_embedding(mapped)
    assert mapped.get_input_embeddings().weight is emb and mapped.get_output_embeddings().weight is emb
    assert not any(lo <= emb.data_ptr() < hi for lo, hi in _file_ranges(path))
    assert torch.equal(emb, want)


def test_load_llm_owns_the_embedding(tmp_path):
    folder, want = _tiny_folder(tmp_path, tied=False)
    llm = load_llm(str(folder), device="cpu")  # bf16 as in the file: transformers would keep the map
    emb = llm.model.get_input_embeddings().weight
    assert not any(lo <= emb.data_ptr() < hi
                   for lo, hi in _file_ranges(os.path.realpath(folder / "model.safetensors")))
    assert torch.equal(emb, want)
