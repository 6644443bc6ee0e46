"""load_llm copies what still lies in the weights file's memory map into the process's own
memory (pipeline/llm/runner/own_memory.py): afterwards no mapping of the file is left (also
where the folder's files are symlinks, as in a hub snapshot), the values and tied weights are
unchanged."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch

from pipeline.llm.loader import llm_folder, load_llm
from pipeline.llm.runner.own_memory import file_ranges, own_weights


def _file_maps(path: Path) -> list[str]:
    with open(f"/proc/{os.getpid()}/maps") as fh:
        return [line for line in fh if line.rstrip().endswith(os.path.realpath(path))]


def _tiny_folder(tmp_path: Path, tied: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Qwen2 (q/k/v biases, norms, embedding) saved as bf16 safetensors."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))
    model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(llm_folder("smollm2"))).save_pretrained(tmp_path)
    return tmp_path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_maps_are_parsed_for_file_backed_ranges_only():
    maps = ("7f00-7f80 r--p 00000000 fe:00 12 /m/model.safetensors\n"
            "8000-9000 rw-p 00000000 00:00 0 [heap]\n"
            "a000-b000 rw-p 00000000 00:00 0 \n"
            "c000-d000 r--p 00001000 fe:00 12 /blobs/ab12 (deleted)\n")
    assert file_ranges(maps) == [(0x7f00, 0x7f80), (0xc000, 0xd000)]


def test_every_mapped_tensor_is_copied_the_map_goes_and_ties_stay(tmp_path):
    from transformers import AutoModelForCausalLM

    folder, want = _tiny_folder(tmp_path, tied=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    emb = model.get_input_embeddings().weight
    assert _file_maps(folder / "model.safetensors")  # what transformers hands over: views of the map
    report = own_weights(model)
    gc.collect()
    assert report.maps_read and report.tensors >= 2 * 7  # per layer: 2 norms, 3 biases, ...
    assert not _file_maps(folder / "model.safetensors")
    assert model.get_input_embeddings().weight is emb and model.get_output_embeddings().weight is emb
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items() if k in got)


def test_load_llm_leaves_no_map_of_the_weights(tmp_path):
    folder, want = _tiny_folder(tmp_path, tied=False)
    for device in ("cpu", "cpu-int4"):
        llm = load_llm(str(folder), device=device)
        gc.collect()
        assert not _file_maps(folder / "model.safetensors"), device
        assert torch.equal(llm.model.get_input_embeddings().weight, want["model.embed_tokens.weight"])
        with torch.inference_mode():
            assert llm.model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()
        del llm


def test_without_proc_maps_only_the_embedding_is_copied(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from pipeline.llm.runner import own_memory

    folder, want = _tiny_folder(tmp_path, tied=False)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    ranges = file_ranges()
    assert ranges
    monkeypatch.setattr(own_memory, "file_ranges", lambda: None)
    report = own_weights(model)
    emb = model.get_input_embeddings().weight
    assert report == own_memory.OwnReport(1, emb.numel() * emb.element_size(), maps_read=False)
    in_map = [any(lo <= t.untyped_storage().data_ptr() < hi for lo, hi in ranges) for t in (emb, model.lm_head.weight)]
    assert in_map == [False, True] and torch.equal(emb, want["model.embed_tokens.weight"])


def test_a_hub_snapshot_of_symlinked_files_is_copied_too(tmp_path):
    """A hub snapshot's files are symlinks to blobs elsewhere; the maps name the blobs."""
    folder, want = _tiny_folder(tmp_path / "saved", tied=False)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        f.rename(blobs / f.name)
        (snap / f.name).symlink_to(blobs / f.name)
    llm = load_llm(str(snap), device="cpu-int4")
    gc.collect()
    assert not _file_maps(blobs / "model.safetensors")
    assert torch.equal(llm.model.get_input_embeddings().weight, want["model.embed_tokens.weight"])
