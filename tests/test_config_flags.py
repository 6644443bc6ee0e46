"""``voxpipe serve``'s flags are generated from the config dataclasses: every field has exactly
one flag, no flag holds a default of its own, every flag name of before still sets the same
field, ``--help`` is grouped by section, and each section checks its own fields."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

import pytest

from cli.flags import config_flags, config_from_args, first_sentence
from cli.main import build_parser
from cli.serve import serve_config
from pipeline.config import (
    AdmissionConfig,
    AsrConfig,
    DegradeConfig,
    LlmConfig,
    SchedulerConfig,
    ServerConfig,
    TtsConfig,
    TurnConfig,
    VoxpipeConfig,
)
from pipeline.config_fields import field_docs

NOT_CONFIG = {"help", "log_level", "ray", "ray_config", "ray_replicas", "ray_existing", "ray_cpus"}
"""The serve flags that are not configuration fields."""


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("VOXPIPE_TOKEN", raising=False)
    monkeypatch.delenv("VOXPIPE_FAULTS", raising=False)


def serve_actions() -> list[argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]._actions


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def sections() -> list[tuple[str, type]]:
    cfg = VoxpipeConfig()
    return [(f.name, type(getattr(cfg, f.name))) for f in dataclasses.fields(VoxpipeConfig)]


def test_every_field_has_exactly_one_flag_and_every_flag_one_field():
    actions = serve_actions()
    dests = [a.dest for a in actions]
    for name, cls in sections():
        for f in dataclasses.fields(cls):
            assert dests.count(f"{name}.{f.name}") == 1, f"{cls.__name__}.{f.name}"
    fields = {f"{name}.{f.name}" for name, cls in sections() for f in dataclasses.fields(cls)}
    assert {d for d in dests if "." in d} == fields
    assert {d for d in dests if "." not in d} == NOT_CONFIG


def test_no_flag_holds_a_default_of_its_own():
    """argparse leaves an absent flag out (SUPPRESS), so its field keeps the dataclass default."""
    config = [a for a in serve_actions() if "." in a.dest]
    assert config and all(a.default is argparse.SUPPRESS for a in config)
    assert not {k for k in vars(parse()) if "." in k}


def test_no_flags_is_the_default_config():
    assert config_from_args(parse(), environ={}) == VoxpipeConfig()
    assert serve_config(parse()) == VoxpipeConfig()


def test_every_field_has_a_help_line():
    for _, cls in sections():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert first_sentence(docs.get(f.name, "")), f"{cls.__name__}.{f.name} has no docstring"
    for flag in config_flags():
        assert flag.help() and "\n" not in flag.help()


DEFAULT_SLOW = DegradeConfig().breaker_slow_ms
EXISTING = [  # every flag before the flags were generated: (argv, section, field, value)
    (["--host", "0.0.0.0"], "server", "host", "0.0.0.0"),
    (["--port", "9000"], "server", "port", 9000),
    (["--max-sessions", "5"], "server", "max_sessions", 5),
    (["--llm", "smollm2"], "llm", "model", "smollm2"),
    (["--llm-api-key", "k"], "llm", "api_key", "k"),
    (["--tokenizer", "/tok"], "llm", "tokenizer", "/tok"),
    (["--llm-timeout-s", "5"], "llm", "remote_timeout_s", 5.0),
    (["--asr-model", "base"], "asr", "model", "base"),
    (["--asr-batch-size", "4"], "asr", "max_batch_size", 4),
    (["--voice", "/v.onnx"], "tts", "voices", ("/v.onnx",)),
    (["--tts", "coqui:/m"], "tts", "backend", "coqui:/m"),  # split into backend and voice at start-up
    (["--device", "cpu-int4"], "llm", "device", "cpu-int4"),
    (["--llm-threads", "2"], "llm", "threads", 2),
    (["--llm-burst-threads", "0"], "llm", "burst_threads", 0),
    (["--tts-threads", "2"], "tts", "threads", 2),
    (["--max-new-tokens", "50"], "llm", "max_new_tokens", 50),
    (["--max-batch-size", "4"], "llm_batch", "max_batch_size", 4),
    (["--max-wait-ms", "5"], "llm_batch", "max_wait_ms", 5.0),
    (["--memory-budget", "512"], "llm", "memory_budget_mb", 512.0),
    (["--no-prefix-cache"], "llm", "prefix_cache", False),
    (["--end-silence-ms", "700"], "turn", "end_silence_ms", 700),
    (["--no-vad-gate"], "turn", "vad_gate", False),
    (["--early-end-ms", "0"], "turn", "early_end_ms", 0),
    (["--slo-ms", "3000"], "admission", "slo_ms", 3000.0),
    (["--no-admission"], "admission", "enabled", False),
    (["--fallback-llm", "none"], "degrade", "fallback_llm", "none"),
    (["--preload-fallback"], "degrade", "preload_fallback", True),
    (["--fault", "llm:oom@1x2", "--fault", "tts:slow:9@1x*"], "degrade", "faults", ("llm:oom@1x2", "tts:slow:9@1x*")),
    (["--ladder-calm-s", "5"], "degrade", "ladder_calm_s", 5.0),
    (["--breaker-open-s", "3"], "degrade", "breaker_open_s", 3.0),
    (["--breaker-slow-ms", "tts=100"], "degrade", "breaker_slow_ms", {**DEFAULT_SLOW, "tts": 100.0}),
    (["--adapt-down-s", "7"], "degrade", "adapt_down_s", 7.0),
    (["--no-adapt"], "degrade", "adapt", False),
    (["--token", "s3cret"], "server", "token", "s3cret"),
    (["--allow-origin", "https://a.example", "--allow-origin", "*"], "server", "allow_origins",
     ("https://a.example", "*")),
    (["--allow-host", "box.lan"], "server", "allow_hosts", ("box.lan",)),
    (["--idle-timeout-s", "0"], "server", "idle_timeout_s", 0.0),
    (["--audio-rate-x", "1.5"], "server", "audio_rate_x", 1.5),
    (["--audio-burst-s", "10"], "server", "audio_burst_s", 10.0),
    (["--text-rate", "5"], "server", "text_rate", 5.0),
]


@pytest.mark.parametrize(("argv", "section", "field", "value"), EXISTING, ids=[e[0][0] for e in EXISTING])
def test_every_existing_flag_sets_the_same_field(argv, section, field, value):
    cfg = config_from_args(parse(*argv), environ={})
    default = VoxpipeConfig()
    assert getattr(getattr(cfg, section), field) == value
    changed = dataclasses.replace(getattr(default, section), **{field: value})
    assert cfg == dataclasses.replace(default, **{section: changed})  # and nothing else moved


def test_the_non_config_flags_still_parse():
    args = parse("--ray", "auto", "--ray-config", "x.yaml", "--ray-replicas", "llm=2", "--ray-existing",
                 "--ray-cpus", "2", "--log-level", "DEBUG")
    assert (args.ray, args.ray_config, args.ray_replicas, args.ray_existing, args.ray_cpus, args.log_level) == (
        "auto", "x.yaml", ["llm=2"], True, 2, "DEBUG")


@pytest.mark.parametrize(("argv", "section", "field", "value"), [
    (["--asr-beam-size", "3"], "asr", "beam_size", 3),
    (["--admission-headroom", "0.5"], "admission", "headroom", 0.5),
    (["--static-batching"], "llm_batch", "static", True),
    (["--vad-threshold", "0.6"], "turn", "threshold", 0.6),
    (["--tts-workers", "2"], "tts", "workers", 2),
    (["--breaker-probes", "5"], "degrade", "breaker_probes", 5),
    (["--keepalive-s", "30"], "server", "keepalive_s", 30.0),
    (["--llm-examples", '[["Hi", "Hello!"]]'], "llm", "examples", (("Hi", "Hello!"),)),
    (["--llm-examples", "[]"], "llm", "examples", ()),
    (["--llm-system-prompt", "Be brief."], "llm", "system_prompt", "Be brief."),
])
def test_new_flags_are_named_by_section(argv, section, field, value):
    assert getattr(getattr(config_from_args(parse(*argv), environ={}), section), field) == value


def test_environment_variables():
    assert config_from_args(parse(), environ={"VOXPIPE_TOKEN": "t"}).server.token == "t"
    assert config_from_args(parse(), environ={"VOXPIPE_TOKEN": ""}).server.token is None
    assert config_from_args(parse("--token", "flag"), environ={"VOXPIPE_TOKEN": "t"}).server.token == "flag"
    env = {"VOXPIPE_FAULTS": "asr:error@1x*"}
    assert config_from_args(parse("--fault", "llm:oom"), environ=env).degrade.faults == ("llm:oom", "asr:error@1x*")
    with pytest.raises(ValueError, match="^VOXPIPE_FAULTS: "):
        config_from_args(parse(), environ={"VOXPIPE_FAULTS": " , ; "})
    with pytest.raises(ValueError, match="^VOXPIPE_TOKEN: server.token is empty"):
        config_from_args(parse(), environ={"VOXPIPE_TOKEN": "  "})


@pytest.mark.parametrize(("argv", "says"), [
    (["--breaker-slow-ms", "tts"], "--breaker-slow-ms 'tts': expected STAGE=MS"),
    (["--breaker-slow-ms", "tts=fast"], "--breaker-slow-ms 'tts=fast': expected STAGE=MS"),
    (["--llm-examples", "[[1"], "--llm-examples: not JSON"),
])
def test_a_value_that_does_not_parse_names_its_flag(argv, says):
    with pytest.raises(ValueError) as err:
        config_from_args(parse(*argv), environ={})
    assert str(err.value).startswith(says)


def test_bad_examples_are_refused():
    cfg = config_from_args(parse("--llm-examples", '[["only the user"]]'), environ={})
    with pytest.raises(ValueError, match="llm.examples"):
        cfg.validate()


def test_a_number_flag_takes_numbers_only(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("--port", "http")
    assert exit_.value.code == 2 and "--port" in capsys.readouterr().err


def test_help_is_grouped_by_section_with_short_lines(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    text = capsys.readouterr().out
    assert text.startswith("usage: voxpipe serve [options]\n")
    headings = [f"{name} ({cls.__name__}):" for name, cls in sections()] + ["ray:"]
    at = [text.index(f"\n{h}\n") for h in headings]
    assert at == sorted(at)
    for flag in config_flags():  # each flag is listed under its own section's heading
        i = next(i for i, (name, _) in enumerate(sections()) if name == flag.section)
        where = re.search(rf"^  {re.escape(flag.name)}[ \n]", text, re.MULTILINE).start()
        assert at[i] < where < at[i + 1], flag.name
    assert "(default: 2000 ms)" in text and "(default: 96)" in text and "(default: $VOXPIPE_TOKEN)" in text
    assert "Turn off (on by default): reuse KV" in text


def test_the_token_is_never_shown_in_help(capsys, monkeypatch):
    monkeypatch.setenv("VOXPIPE_TOKEN", "do-not-print-me")
    with pytest.raises(SystemExit):
        parse("--help")
    assert "do-not-print-me" not in capsys.readouterr().out


def test_first_sentence():
    assert first_sentence("Silence that ends a turn (ms).\n\nMore.") == "Silence that ends a turn (ms)"
    assert first_sentence("A ``Host`` name, e.g. behind a proxy. More") == "A Host name, e.g. behind a proxy"
    assert first_sentence("See :mod:`pipeline.asr.turn` and :func:`~a.b.c`. x") == "See pipeline.asr.turn and c"


@pytest.mark.parametrize(("section", "bad", "says"), [
    (TurnConfig, {"threshold": 0.2}, "neg_threshold < threshold"),
    (TurnConfig, {"early_end_ms": 600}, "early_end_ms < end_silence_ms"),
    (AsrConfig, {"threads": 0}, "asr.threads"),
    (AsrConfig, {"trim_s": 25.0}, "trim_s < max_buffer_s"),
    (LlmConfig, {"threads": 0}, "llm.threads"),
    (LlmConfig, {"burst_threads": -1}, "llm.burst_threads"),
    (LlmConfig, {"memory_budget_mb": math.nan}, "memory_budget_mb"),
    (LlmConfig, {"remote_timeout_s": 0.0}, "remote_timeout_s"),
    (SchedulerConfig, {"max_batch_size": 0}, "llm_batch: max_batch_size"),
    (TtsConfig, {"workers": 0}, "tts.workers"),
    (TtsConfig, {"backend": "espeak"}, "piper or coqui"),
    (AdmissionConfig, {"slo_ms": 50.0}, "admission.slo_ms"),
    (DegradeConfig, {"faults": ("llm:explode",)}, "llm:explode"),
    (DegradeConfig, {"breaker_probes": 0}, "breaker_probes"),
    (ServerConfig, {"receive_queue": 0}, "receive_queue"),
])
def test_each_section_checks_its_own_fields(section, bad, says):
    section().validate()
    with pytest.raises(ValueError, match=says):
        section(**bad).validate()
    cfg = VoxpipeConfig()
    name = next(n for n, cls in sections() if cls is section)
    setattr(cfg, name, section(**bad))
    with pytest.raises(ValueError, match=says):
        cfg.validate()


def test_the_whole_config_keeps_the_checks_across_sections():
    cfg = VoxpipeConfig(llm_batch=SchedulerConfig(max_kv_tokens=1000))
    with pytest.raises(ValueError, match="max_kv_tokens must fit at least one full request"):
        cfg.validate()
    LlmConfig(burst_threads=None).validate()  # None: auto


def numeric_fields() -> list[tuple[type, str, object]]:
    """(section class, field name, an absurd value of the field's kind) for every int and
    float field of every section: NaN for a float, a huge or negative count for an int."""
    out: list[tuple[type, str, object]] = []
    for _, cls in sections():
        default = cls()
        for f in dataclasses.fields(cls):
            value = getattr(default, f.name)
            if isinstance(value, bool) or f.name == "burst_threads":
                continue
            if isinstance(value, float) or f.type in ("float", "float | None"):
                out += [(cls, f.name, math.nan), (cls, f.name, math.inf)]
            elif isinstance(value, int) or f.type in ("int", "int | None"):
                out += [(cls, f.name, -(10 ** 12)), (cls, f.name, 10 ** 15)]
    return out


@pytest.mark.parametrize(("section", "name", "bad"), numeric_fields(),
                         ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
def test_every_number_field_refuses_nan_infinity_and_absurd_counts(section, name, bad):
    """Every number a flag can set is range-checked: a field the flags newly expose cannot make
    a queue unbounded (``--asr-queue-size 0``) or a beam empty."""
    with pytest.raises(ValueError, match=name):
        section(**{name: bad}).validate()


def test_burst_threads_auto_is_not_checked_but_a_bad_count_is():
    LlmConfig(burst_threads=None).validate()
    with pytest.raises(ValueError, match="burst_threads"):
        LlmConfig(burst_threads=10 ** 6).validate()


def test_a_zero_queue_is_refused_not_unbounded():
    for section in (AsrConfig, LlmConfig, TtsConfig):
        with pytest.raises(ValueError, match="queue_size"):
            section(queue_size=0).validate()
