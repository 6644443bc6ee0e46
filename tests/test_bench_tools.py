"""`voxpipe bench tools`: the set's shape, the lenient argument checks, one verdict per case,
and a short run with SmolLM2 whose table and counts add up (no speed assertion)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench.tool_set import CASES, TOOLS, Case, args_ok, load_cases, tool_specs
from bench.tools import NONE_VERDICTS, TOOL_VERDICTS, Row, format_table, judge, main, run_model


def test_the_set_has_every_kind_and_enough_chit_chat():
    kinds = [c.kind for c in CASES]
    assert len(CASES) >= 40 and kinds.count("none") >= 10
    assert set(kinds) == {*TOOLS, "none"}
    assert {s.name for s in tool_specs()} == {fn.__name__ for fn in TOOLS.values()}
    assert len({c.text for c in CASES}) == len(CASES)
    picked = load_cases(3)
    assert [c.kind for c in picked] == ["none", "time", "timer"]


@pytest.mark.parametrize(("case", "arguments", "ok"), [
    (Case("five minutes", "set_timer", {"seconds": 300}), {"minutes": 5}, True),
    (Case("five minutes", "set_timer", {"seconds": 300}), {"seconds": 300, "label": "tea"}, True),
    (Case("five minutes", "set_timer", {"seconds": 300}), {"minutes": 4, "seconds": 60}, True),
    (Case("five minutes", "set_timer", {"seconds": 300}), {"seconds": 5}, False),
    (Case("12 x 7", "calculate", {"result": 84}), {"expression": "12*7"}, True),
    (Case("12 x 7", "calculate", {"result": 84}), {"expression": "12 x 7"}, False),
    (Case("paris", "get_weather", {"city": "Paris"}), {"city": "paris, France"}, True),
    (Case("paris", "get_weather", {"city": "Paris"}), {"city": "Lyon"}, False),
    (Case("kitchen on", "switch_light", {"room": "kitchen", "state": "on"}), {"room": "Kitchen", "state": "on"}, True),
    (Case("kitchen on", "switch_light", {"room": "kitchen", "state": "on"}), {"room": "kitchen", "state": "off"},
     False),
    (Case("time", "get_time"), {}, True),
])
def test_arguments_are_checked_leniently(case, arguments, ok):
    assert args_ok(case, arguments) is ok


@pytest.mark.parametrize(("case", "reply", "verdict"), [
    (Case("t", "set_timer", {"seconds": 300}), '<tool_call>{"name": "set_timer", "arguments": {"minutes": 5}}'
                                               '</tool_call>', "right"),
    (Case("t", "set_timer", {"seconds": 300}), '{"name": "set_timer", "arguments": {"minutes": 3}}', "wrong args"),
    (Case("t", "set_timer", {"seconds": 300}), '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "wrong tool"),
    (Case("t", "set_timer", {"seconds": 300}), "<tool_call>{not json</tool_call>", "malformed"),
    (Case("t", "set_timer", {"seconds": 300}), "Sure, five minutes.", "missed"),
    (Case("hi", None), "Hello there!", "quiet"),
    (Case("hi", None), '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "false call"),
    (Case("hi", None), '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "false call"),
])
def test_each_reply_gets_one_verdict(case, reply, verdict):
    assert judge(case, reply, tool_specs())[0] == verdict


def _counts_add_up(row: Row) -> None:
    verdicts = [o.verdict for o in row.outcomes]
    assert row.cases == len(row.outcomes) == row.tool_cases + row.none_cases
    assert row.right + row.wrong_args + row.wrong_tool + row.malformed_tool + row.missed == row.tool_cases
    assert row.quiet + row.false_calls == row.none_cases
    assert all(v in (TOOL_VERDICTS if o.expected else NONE_VERDICTS) for v, o in zip(verdicts, row.outcomes))
    assert row.tool_rate == round(row.tool_ok / row.cases, 3)
    assert row.tool_args_rate == round(row.tool_args_ok / row.cases, 3)
    assert row.tool_args_ok <= row.tool_ok <= row.cases
    assert sum(int(v.split("/")[1]) for v in row.by_kind.values()) == row.cases


@pytest.mark.slow
def test_a_short_run_with_smollm2_fills_every_column(capsys):
    args = SimpleNamespace(device="cpu", threads=1, cold=1, cases=3, show=3, llm=["smollm2"], json=False,
                           framing="server")
    row = run_model("smollm2", load_cases(3), args)
    _counts_add_up(row)
    assert row.none_cases == 1 and row.tool_cases == 2
    assert row.prompt_tokens_tools > row.prompt_tokens_plain > 0  # the tools' section lengthens the prompt
    assert all(o.ttft_ms > 0 and o.ttft_plain_ms > 0 for o in row.outcomes)
    assert row.ttft_cold_plain_ms > 0 and row.ttft_cold_tools_ms > 0
    table = format_table([row]).splitlines()
    assert len(table) == 4 and table[0].count("|") == table[2].count("|") == 14
    assert table[2].startswith("| smollm2 | server | 3 | ")
    assert table[3].startswith("smollm2 (server), right tool + args per kind: none ")

    args.json = True
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["cases"] for r in out["rows"]] == [3] and len(out["rows"][0]["outcomes"]) == 3
