"""The lean decode step (pipeline/llm/runner/decode_step.py): bit-identical logits and caches
to transformers' forward, for Llama and Qwen2, bf16 and int4, batches with left padding;
models it cannot prove that for take transformers' forward."""

from __future__ import annotations

import pytest
import torch

from pipeline.llm.runner import decode_step, native
from pipeline.llm.runner.native import attn
from pipeline.llm.runner.quant_linear import quantize_linears
from pipeline.llm.runner.runner import ModelRunner
from tests.test_batching import run


def _tiny(kind: str, quant: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else
             Qwen2ForCausalLM(Qwen2Config(**common))).eval().to(torch.bfloat16)
    if quant:
        quantize_linears(model, "int4", max_rows=None)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("quant", [False, True])
def test_lean_decode_and_mixed_steps_give_the_same_bits_as_transformers(kind, quant, monkeypatch):
    model = _tiny(kind, quant)
    g = torch.Generator().manual_seed(3)
    specs = [(i, torch.randint(1, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist(), 12)
             for i in range(4)]
    lean = ModelRunner(model, torch.device("cpu"), pad_id=0, prefix_cache=False)
    plain = ModelRunner(model, torch.device("cpu"), pad_id=0, prefix_cache=False, lean_decode=False)
    assert lean.lean_decode and not plain.lean_decode
    calls = {"decode": 0, "mixed": 0}
    def counting(name: str, real):
        def call(*a):
            calls[name] += 1
            return real(*a)
        return call

    for name in calls:
        monkeypatch.setattr(decode_step, name, counting(name, getattr(decode_step, name)))
    chunks = []
    real_chunk = attn.chunk
    monkeypatch.setattr(attn, "chunk", lambda *a, **kw: chunks.append(real_chunk(*a, **kw)) or chunks[-1])
    logits: dict[str, list[torch.Tensor]] = {"lean": [], "plain": []}
    head = model.lm_head.forward
    for name, runner in (("lean", lean), ("plain", plain)):
        def recording(h, name=name):  # every step's logits, whichever path computed them
            out = head(h)
            logits[name].append(out.clone())
            return out

        model.lm_head.forward = recording
        tokens = run(model, specs, max_batch=4, runner=runner)  # rows join at different steps: left padding
        if name == "lean":
            lean_calls, lean_tokens = dict(calls), tokens
    assert calls == lean_calls and lean_calls["decode"] > 5 and lean_calls["mixed"] >= 2
    if native.available():  # prompt chunks of mixed steps ran voxpipe's attention kernel, in both runs
        assert chunks and all(c is not None for c in chunks)
    assert tokens == lean_tokens
    assert len(logits["lean"]) == len(logits["plain"])
    for a, b in zip(logits["lean"], logits["plain"]):
        assert torch.equal(a, b)


def test_models_it_cannot_prove_run_transformers_forward():
    model = _tiny("llama", False)
    assert ModelRunner(model, torch.device("cpu"), pad_id=0).lean_decode
    assert not ModelRunner(model, torch.device("cpu"), pad_id=0, mixed=False).lean_decode
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)  # a hook it would skip
    assert not decode_step.supports(model)
    handle.remove()
    assert decode_step.supports(model)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64)).eval()
    assert not decode_step.supports(gpt2)


def test_steps_are_padded_to_a_bucket_only_where_a_linear_runs_onednn():
    assert ModelRunner(_tiny("llama", False), torch.device("cpu"), pad_id=0).bucket == ModelRunner.BUCKET
    if native.available():
        assert ModelRunner(_tiny("qwen2", True), torch.device("cpu"), pad_id=0).bucket == 1
    with_copy = _tiny("llama", False)
    quantize_linears(with_copy, "int4", max_rows=8)  # wider steps run the bf16 copy: oneDNN again
    assert ModelRunner(with_copy, torch.device("cpu"), pad_id=0).bucket == ModelRunner.BUCKET
