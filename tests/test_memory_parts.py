"""``voxpipe_memory_bytes{part}`` (pipeline/memory_parts.py, issue 37): the parts sum to the
RSS given, ``rest`` never goes below 0, and the LLM's parts match a tiny random Llama's
tensors as it decodes and after."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline import memory_parts, metrics
from pipeline.config import LlmConfig, SchedulerConfig
from pipeline.engines import Engines
from pipeline.llm.engine import LlmEngine
from pipeline.memory_parts import PARTS, split_rss
from tests.fakes import FakeAsr, FakeTts, FakeVad, fake_engines
from tests.test_llm_memory import ask, tiny

MIB = 1 << 20


def test_parts_sum_to_the_rss_given():
    known = {"weights_llm": 300 * MIB, "weights_asr": 40 * MIB, "kv_used": 3 * MIB, "prefix_cache": 5 * MIB,
             "files": 250 * MIB}
    parts = split_rss(1000 * MIB, known)
    assert list(parts) == list(PARTS)
    assert sum(parts.values()) == 1000 * MIB
    assert parts["rest"] == 402 * MIB and parts["weights_tts"] == 0
    assert memory_parts.measure(1000 * MIB, {"weights_asr": 40 * MIB}, files=250 * MIB)["rest"] == 710 * MIB


def test_rest_is_never_negative_and_bad_parts_are_refused():
    parts = split_rss(100, {"weights_llm": 150})  # an estimate over RSS (e.g. weights not yet paged in)
    assert parts["rest"] == 0 and sum(parts.values()) == 150
    assert split_rss(0, {}) == dict.fromkeys(PARTS, 0)
    with pytest.raises(ValueError, match="unknown memory parts"):
        split_rss(100, {"rest": 1})
    with pytest.raises(ValueError, match=">= 0"):
        split_rss(100, {"kv_used": -1})
    with pytest.raises(ValueError, match=">= 0"):
        split_rss(-1, {})


def scrape(engines: Engines | None) -> tuple[float, dict[str, float]]:
    """(``voxpipe_process_rss_bytes``, ``voxpipe_memory_bytes`` by part) from one render."""
    rss, parts = 0.0, {}
    for family in text_string_to_metric_families(metrics.render(engines).decode()):
        for s in family.samples:
            if s.name == "voxpipe_process_rss_bytes":
                rss = s.value
            elif s.name == "voxpipe_memory_bytes":
                parts[s.labels["part"]] = s.value
    return rss, parts


def test_the_gauge_sums_to_the_rss_gauge_over_fakes():
    engines = fake_engines()
    engines.weights = {"weights_asr": 4 * MIB, "weights_tts": 6 * MIB, "weights_vad": MIB}
    rss, parts = scrape(engines)
    assert set(parts) == set(PARTS)
    assert sum(parts.values()) == rss > 11 * MIB
    assert parts["weights_tts"] == 6 * MIB and parts["weights_llm"] == parts["kv_used"] == 0  # a fake LLM: none
    assert 0 < parts["files"] < rss  # the libraries at least (Linux)
    rss, parts = scrape(None)
    assert parts["rest"] + parts["files"] == rss


def test_the_llm_parts_are_its_tensors_while_decoding_and_after():
    eng = LlmEngine(tiny(), LlmConfig(max_new_tokens=16), SchedulerConfig(max_wait_ms=0))
    engines = Engines(vad=FakeVad(), asr=FakeAsr(), llm=eng, tts=FakeTts())
    per_token = eng.memory.per_token
    eng.submit(ask("Hello there.", 16))
    for _ in range(4):  # prefill, then a few decode steps
        eng.step()
    req = next(r.req for r in eng.runner.slots if r is not None)
    assert req is not None and eng.runner.batch is not None
    rss, parts = scrape(engines)
    assert parts["weights_llm"] == eng.memory.weights == eng.runner.weight_bytes
    assert parts["kv_used"] == (len(req.prompt_ids) + len(req.output_ids)) * per_token
    assert parts["kv_used"] + parts["kv_reserved"] == eng.runner.batch.nbytes  # the buffers, spare columns too
    assert sum(parts.values()) == rss
    while eng.step() == 0:  # to the end of the reply
        pass
    rss, parts = scrape(engines)
    blocks = eng.runner.blocks
    assert blocks is not None and blocks.tokens > 0  # the prompt and reply are cached
    assert parts["kv_used"] == parts["kv_reserved"] == 0
    assert parts["prefix_cache"] == blocks.tokens * per_token
    assert sum(parts.values()) == rss


def test_an_llm_on_a_gpu_holds_no_host_memory_here():
    plan = SimpleNamespace(weights=10 * MIB, per_token=512)
    runner = SimpleNamespace(device="cuda:0", blocks=None, kv_bytes=lambda per_token: (0, 0))
    assert memory_parts.llm_parts(SimpleNamespace(memory=plan, runner=runner)) == {}
    runner.device = "cpu"
    assert memory_parts.llm_parts(SimpleNamespace(memory=plan, runner=runner)) == {
        "weights_llm": 10 * MIB, "kv_used": 0, "kv_reserved": 0, "prefix_cache": 0}
    assert memory_parts.llm_parts(SimpleNamespace()) == {}  # a remote LLM or a fake


def test_anonymous_rss_sees_memory_touched():
    import numpy as np

    before = memory_parts.anonymous_rss()
    block = np.ones(64 * MIB // 8)  # 64 MiB written: resident, anonymous
    assert memory_parts.anonymous_rss() - before > 48 * MIB
    del block


def test_malloc_free_counts_what_glibc_keeps_after_free():
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(8192)]  # 32 MiB in small chunks (under the mmap threshold)
    before = memory_parts.malloc_free()
    for b in blocks[::2]:  # every other one: the freed chunks cannot merge into the top and be trimmed
        libc.free(b)
    assert memory_parts.malloc_free() - before > 14 * MIB
    body = metrics.render(None).decode()
    assert float(body.split("\nvoxpipe_malloc_free_bytes ")[1].split()[0]) > 14 * MIB
    for b in blocks[1::2]:
        libc.free(b)


@pytest.mark.slow
def test_the_real_servers_parts_name_its_runtime_and_weights(server):
    """The real server (SmolLM2, Whisper, Piper, Silero, Smart Turn): ``runtime`` (measured
    before the models loaded) and every model's weights are named, and the parts sum to the
    RSS gauge of the same scrape."""
    import urllib.request

    with urllib.request.urlopen(server["http"] + "/metrics", timeout=30) as r:
        body = r.read().decode()
    rss, parts = 0.0, {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == "voxpipe_process_rss_bytes":
                rss = s.value
            elif s.name == "voxpipe_memory_bytes":
                parts[s.labels["part"]] = s.value
    assert set(parts) == set(PARTS)
    assert 50 * MIB < parts["runtime"] < rss  # importing torch alone takes more than that
    for part in ("weights_llm", "weights_asr", "weights_tts", "weights_vad", "files"):
        assert parts[part] > 0, part
    assert sum(parts.values()) == pytest.approx(rss, abs=1)
