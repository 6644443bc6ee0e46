"""Tool calling's pure core (pipeline/tools/): specs from callables, the incremental
``<tool_call>`` parser (Hypothesis: any split of a stream gives the same events), call
validation against JSON Schema, and prompts rendered with tools by the real tokenizers."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.tools.parse import CLOSE, OPEN, ToolCallParser
from pipeline.tools.render import assistant_message, inline_tools, template_takes_tools, tool_message, tool_prompt
from pipeline.tools.spec import parse_docstring, spec_from_callable
from pipeline.tools.types import Event, Text, ToolBlock, ToolCall, ToolCallError, ToolCallFault, ToolSpec
from pipeline.tools.validate import validate_call

WEATHER = ToolSpec("get_weather", "Current weather in a city.", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
})
TIME = ToolSpec("get_time", "The time now.")


def merged(events: list[Event]) -> list[Event]:
    """``events`` with neighbouring texts joined (text may come in any chunking)."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, Text) and out and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def run(deltas: list[str]) -> list[Event]:
    parser = ToolCallParser()
    events = [e for d in deltas for e in parser.feed(d)]
    return events + parser.finish()


# ---- the parser ---------------------------------------------------------------------------

def test_text_and_a_call_as_qwen_writes_them():
    stream = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    assert run([stream]) == [Text("Let me check.\n"),
                             ToolBlock('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'),
                             Text("\n")]


def test_a_tag_split_across_deltas_is_never_spoken():
    parser = ToolCallParser()
    assert parser.feed("Sure<tool") == [Text("Sure")]
    assert parser.feed("_ca") == []
    assert parser.feed('ll>{"name": "get_time"}</tool_') == []
    assert parser.feed("call>ok") == [ToolBlock('{"name": "get_time"}'), Text("ok")]
    assert parser.finish() == []


def test_a_start_that_is_no_tag_is_text_after_all():
    parser = ToolCallParser()
    assert parser.feed("a <tool") == [Text("a ")]
    assert parser.feed("box>") == [Text("<toolbox>")]
    assert parser.feed("x <") == [Text("x ")]
    assert parser.finish() == [Text("<")]


def test_an_unterminated_block_comes_out_at_finish():
    parser = ToolCallParser()
    assert parser.feed('<tool_call>\n{"name": "get_time", "arguments": {}}\n') == []
    assert parser.finish() == [ToolBlock('\n{"name": "get_time", "arguments": {}}\n', closed=False)]
    assert parser.feed("again") == [Text("again")]  # finish resets


def test_a_stray_close_tag_is_dropped_and_a_nested_open_is_raw():
    assert run(["one </tool_call>two"]) == [Text("one "), Text("two")]
    assert run(["<tool_call>a<tool_call>b</tool_call>"]) == [ToolBlock("a<tool_call>b")]


def test_two_calls_in_a_row():
    stream = "<tool_call>\n{}\n</tool_call>\n<tool_call>\n[]\n</tool_call>"
    assert run([stream]) == [ToolBlock("\n{}\n"), Text("\n"), ToolBlock("\n[]\n")]


def test_a_bare_json_reply_is_one_block():
    # Qwen2.5-Coder-0.5B, greedy, answered the tool prompt with exactly this and no tags
    reply = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    parser = ToolCallParser()
    assert [parser.feed(d) for d in ("\n ", reply[:9], reply[9:])] == [[], [], []]
    assert parser.finish() == [ToolBlock("\n " + reply)]
    assert validate_call(ToolBlock("\n " + reply).raw, [WEATHER], call_id="c").name == "get_weather"
    assert run(["  Hello {x}"]) == [Text("  Hello {x}")]  # a brace later on is text
    assert run(["  ", "\n"]) == [Text("  \n")]
    parser = ToolCallParser(bare_json=False)
    assert parser.feed(reply) + parser.finish() == [Text(reply)]


def test_a_bare_call_followed_by_text_or_in_a_code_fence():
    call = '{"name": "get_time", "arguments": {}}'
    # Qwen2.5-Coder-0.5B went on after its bare call, and fenced one as ```json
    assert run([call[:5], call[5:] + "\nI'll check."]) == [ToolBlock(call), Text("\nI'll check.")]
    fenced = "```json\n" + call + "\n```"
    assert run([fenced[:2], fenced[2:9], fenced[9:]]) == [ToolBlock(call)]
    assert run(["```python\nprint(1)\n```"]) == [Text("```python\nprint(1)\n```")]  # code is text
    assert run(["`x` is a name."]) == [Text("`x` is a name.")]


NEAR_TAGS = st.text(alphabet="<>/_tolca xé\n", max_size=12) | st.sampled_from(
    ["<tool", "<tool_call", "</tool_", "</tool_call", "<", "</", "tool_call>", "<tool_cal>"])


def without(text: str, *tags: str) -> str:
    """``text`` with every ``tags`` taken out, also those the taking out makes."""
    while any(t in text for t in tags):
        for t in tags:
            text = text.replace(t, "")
    return text


@st.composite
def streams(draw) -> tuple[str, list[Event]]:
    """A valid stream (no tag in text, no close tag in a block) and its events, texts joined."""
    events: list[Event] = []
    for is_block, part in draw(st.lists(st.tuples(st.booleans(), NEAR_TAGS), max_size=8)):
        if is_block:
            events.append(ToolBlock(without(part, CLOSE)))
        elif events and isinstance(events[-1], Text):
            events[-1] = Text(events[-1].text + part)
        else:
            events.append(Text(part))
    events = [Text(without(e.text, OPEN, CLOSE)) if isinstance(e, Text) else e for e in events]
    events = [e for e in events if isinstance(e, ToolBlock) or e.text]
    stream = "".join(e.text if isinstance(e, Text) else OPEN + e.raw + CLOSE for e in events)
    return stream, events


@settings(max_examples=400, deadline=None, derandomize=True)
@given(case=streams(), data=st.data())
def test_any_split_of_a_stream_gives_the_same_events(case, data):
    stream, expected = case
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    deltas = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    events = run(deltas)
    assert merged(events) == expected
    assert all(isinstance(e, ToolBlock) or e.text for e in events)  # no empty text
    assert "".join(e.text for e in events if isinstance(e, Text)) == "".join(
        e.text for e in expected if isinstance(e, Text))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(max_size=40), data=st.data())
def test_text_without_tags_comes_out_exactly(text, data):
    text = text.replace("<", "(")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert "".join(e.text for e in run(deltas) if isinstance(e, Text)) == text


# ---- validation ---------------------------------------------------------------------------

def test_a_valid_call():
    raw = '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    assert validate_call(raw, [WEATHER, TIME], call_id="call_1") == ToolCall(
        "call_1", "get_weather", {"city": "Paris", "unit": "c"}, raw)


def test_arguments_as_a_json_string_or_missing_are_accepted():
    call = validate_call('{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}', [WEATHER])
    assert isinstance(call, ToolCall) and call.arguments == {"city": "Oslo"} and call.id.startswith("call_")
    call = validate_call('{"name": "get_time"}', [TIME])
    assert isinstance(call, ToolCall) and call.arguments == {}


@pytest.mark.parametrize("raw", ['{"name": "get_weather", "arguments": {"city": "Paris"', "Paris", "",
                                 '["get_weather"]', '{"arguments": {}}', '{"name": 3, "arguments": {}}',
                                 '{"name": "get_weather", "arguments": [1]}',
                                 '{"name": "get_weather", "arguments": "not json"}', "[" * 100_000])
def test_not_a_json_call(raw):
    err = validate_call(raw, [WEATHER])
    assert isinstance(err, ToolCallError) and err.reason is ToolCallFault.NOT_JSON and err.raw == raw
    assert '{"name": <tool name>, "arguments": {...}}' in err.message


def test_an_unknown_tool():
    err = validate_call('{"name": "get_wether", "arguments": {"city": "Paris"}}', [WEATHER, TIME])
    assert err == ToolCallError(ToolCallFault.UNKNOWN_TOOL, "no tool named 'get_wether' (tools: get_time, get_weather)",
                                '{"name": "get_wether", "arguments": {"city": "Paris"}}', "get_wether")


def test_arguments_against_the_schema():
    err = validate_call('{"name": "get_weather", "arguments": {"unit": "k", "days": 0}}', [WEATHER])
    assert isinstance(err, ToolCallError) and err.reason == "schema" and err.name == "get_weather"
    assert err.message == ("arguments of get_weather do not fit its parameters: arguments: 'city' is a required "
                           "property; arguments.days: 0 is less than the minimum of 1; "
                           "arguments.unit: 'k' is not one of ['c', 'f']")


def test_a_bad_schema_is_the_programmers_error():
    bad = ToolSpec("bad", "Bad.", {"type": "object", "properties": {"x": {"type": "nope"}}})
    with pytest.raises(ValueError, match="not a valid JSON Schema"):
        validate_call('{"name": "bad", "arguments": {}}', [bad])


def test_tool_spec_checks_itself():
    with pytest.raises(ValueError, match="tool name"):
        ToolSpec("get weather", "x")
    with pytest.raises(ValueError, match="object"):
        ToolSpec("f", "x", {"type": "string"})
    assert TIME.to_openai() == {"type": "function", "function": {
        "name": "get_time", "description": "The time now.", "parameters": {"type": "object", "properties": {}}}}
    assert ToolCall("c", "f", {"a": "é"}).to_openai()["function"]["arguments"] == '{"a": "é"}'


# ---- specs from callables -----------------------------------------------------------------

class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


def get_weather(city: str, unit: Unit = Unit.C, days: int = 1, json: bool = False, title: str | None = None) -> str:
    """Current weather
    in a city.

    Args:
        city: the city's name,
            in English.
        unit (Unit): the temperature scale.
        days: days to forecast.

    Returns:
        the forecast.
    """
    return city


def test_spec_from_a_function():
    spec = spec_from_callable(get_weather)
    assert spec.name == "get_weather" and spec.description == "Current weather in a city."
    assert spec.parameters == {
        "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}},
        "properties": {
            "city": {"description": "the city's name, in English.", "type": "string"},
            "unit": {"$ref": "#/$defs/Unit", "default": "celsius", "description": "the temperature scale."},
            "days": {"default": 1, "description": "days to forecast.", "type": "integer"},
            "json": {"default": False, "type": "boolean"},  # a BaseModel attribute's name: fine
            "title": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},  # kept: a property
        },
        "required": ["city"],
        "type": "object",
    }
    call = validate_call('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "fahrenheit"}}', [spec])
    assert isinstance(call, ToolCall)
    assert isinstance(validate_call('{"name": "get_weather", "arguments": {"city": 1}}', [spec]), ToolCallError)


def test_a_function_with_a_literal_and_no_parameters():
    def pick(colour: Literal["red", "blue"]) -> None:
        """Pick a colour."""

    def now() -> str:
        """The time now."""
        return ""

    assert spec_from_callable(pick).parameters == {
        "properties": {"colour": {"enum": ["red", "blue"], "type": "string"}}, "required": ["colour"], "type": "object"}
    assert spec_from_callable(now) == ToolSpec("now", "The time now.", {"properties": {}, "type": "object"})


def _undocumented(x: int) -> None:
    pass


def _star(*args: int) -> None:
    """Doc."""


def _kwargs(**kw: int) -> None:
    """Doc."""


def _positional(x: int, /) -> None:
    """Doc."""


def _unhinted(x) -> None:
    """Doc."""


def _callable(f: Callable[[int], int]) -> None:
    """Doc."""


def _unresolved(x: Nowhere) -> None:  # type: ignore[name-defined]  # noqa: F821
    """Doc."""


def _private(_x: int) -> None:
    """Doc."""


@pytest.mark.parametrize(("fn", "words"), [
    (_undocumented, "no docstring"), (lambda x: x, "no docstring"), (_star, "by name"), (_kwargs, "by name"),
    (_positional, "by name"), (_unhinted, "no type hint"), (_callable, "no JSON Schema"),
    (_unresolved, "does not resolve"), (_private, "starts with '_'")])
def test_unsupported_functions_are_refused(fn, words):
    with pytest.raises(ValueError, match=words):
        spec_from_callable(fn)


def test_a_bad_function_name_is_refused():
    def f(x: int) -> None:
        """Doc."""

    f.__name__ = "no spaces"
    with pytest.raises(ValueError, match="not a tool name"):
        spec_from_callable(f)


def test_docstring_sections():
    summary, args = parse_docstring("One.\n\nTwo.\n\nArgs:\n  a: x: y\n    more\n  b (int): z\nRaises:\n  c: no")
    assert summary == "One. Two." and args == {"a": "x: y more", "b": "z"}


# ---- prompts ------------------------------------------------------------------------------

CALL = ToolCall("call_1", "get_weather", {"city": "Paris"})
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        assistant_message([CALL]), tool_message(CALL, {"temp": 20}), tool_message(CALL, "sunny")]
EXPECTED_TAIL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
                 '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response>\n'
                 '<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n')


def test_inline_tools_writes_hermes_into_plain_messages():
    out = inline_tools([{"role": "user", "content": "hi"}, assistant_message([CALL], "On it."),
                        tool_message(CALL, "sunny")], [TIME])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools\n")
    assert '\n{"type": "function", "function": {"name": "get_time"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": 'On it.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                                      '{"city": "Paris"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert inline_tools([{"role": "user", "content": "hi"}], []) == [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=["qwen", "smollm2"])
def tokenizer(request):
    from pipeline.llm.loader import llm_folder, load_tokenizer

    return request.param, load_tokenizer(str(llm_folder(request.param)))


@pytest.mark.slow
def test_the_real_templates_render_the_tools(tokenizer):
    name, tok = tokenizer
    # Qwen2.5's template takes tools=; SmolLM2-135M's ignores them (inline_tools writes them in)
    assert template_takes_tools(tok) == (name == "qwen")
    text = tool_prompt(tok, CHAT, [WEATHER, TIME], tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    for spec in (WEATHER, TIME):
        assert json.dumps(spec.to_openai(), ensure_ascii=False) in text
    assert text.endswith(EXPECTED_TAIL)
    # the inline Hermes text is the very prompt Qwen2.5's own template writes
    assert text == tool_prompt(tok, CHAT, [WEATHER, TIME], tokenize=False, native=False)
    wire = [*CHAT[:2], {**CHAT[2], "tool_calls": [CALL.to_openai()]}, *CHAT[3:]]  # arguments as a JSON string
    assert tool_prompt(tok, wire, [WEATHER, TIME], tokenize=False) == text
    ids = tool_prompt(tok, CHAT, [WEATHER, TIME])
    assert isinstance(ids, list) and tok.decode(ids) == text
