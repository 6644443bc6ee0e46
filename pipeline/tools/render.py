"""Prompts with tools: the chat template's own tool format where it has one, Hermes' format
written into the messages where it has none.

Qwen2.5's template takes ``tools=`` (OpenAI function dicts): it appends a "# Tools" section
with the signatures in ``<tools></tools>`` to the system prompt, writes an assistant
message's ``tool_calls`` as ``<tool_call>`` blocks and ``role: tool`` messages as
``<tool_response>`` blocks in a user turn. SmolLM2-135M-Instruct's template ignores ``tools``
and ``tool_calls`` (it prints each message's role and content, nothing else): for such a
template :func:`inline_tools` writes the same Hermes text into plain messages, so every
model sees, and is parsed for (:mod:`pipeline.tools.parse`), one format. Sources: Qwen2.5's
``chat_template`` (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct); NousResearch
"Hermes-Function-Calling"; transformers' "Tool use" chat-templating guide.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pipeline.tools.parse import CLOSE, OPEN
from pipeline.tools.types import ToolCall, ToolSpec

TOOLS_INTRO = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
               "\"arguments\": <args-json-object>}\n</tool_call>")
"""Qwen2.5's tool section, word for word: what :func:`inline_tools` adds to the system prompt."""
PROBE = [{"role": "user", "content": "hi"}]
PROBE_TOOL = ToolSpec("probe", "A probe.").to_openai()


def tool_prompt(tokenizer: Any, messages: list[dict], specs: Sequence[ToolSpec], *, tokenize: bool = True,
                native: bool | None = None) -> Any:
    """The prompt of ``messages`` with ``specs`` offered, with the generation prompt: token
    ids (``list[int]``, ``tokenize``) or text (``str``). Through the template's own tools
    when ``native`` (None: :func:`template_takes_tools`, two extra renders: check once and
    pass it where prompts are many), else through :func:`inline_tools`.

    ``messages`` may hold :func:`assistant_message` and :func:`tool_message` items, or
    OpenAI's, whose ``arguments`` strings are decoded first (a template writes them with
    ``tojson``: a string would be quoted twice).

    Raises:
        ValueError: a ``tool_calls`` item whose ``arguments`` string is not JSON.
    """
    if native is None:
        native = bool(specs) and template_takes_tools(tokenizer)
    if specs and native:
        out = tokenizer.apply_chat_template([object_arguments(m) for m in messages],
                                            tools=[s.to_openai() for s in specs],
                                            add_generation_prompt=True, tokenize=tokenize)
    else:
        out = tokenizer.apply_chat_template(inline_tools(messages, specs), add_generation_prompt=True,
                                            tokenize=tokenize)
    if tokenize and (isinstance(out, dict) or hasattr(out, "keys")):
        out = out["input_ids"]
    return list(out) if tokenize else out


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools=`` at all (a probe prompt rendered
    with and without a tool differs)."""
    plain = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=False)
    return plain != tokenizer.apply_chat_template(PROBE, tools=[PROBE_TOOL], add_generation_prompt=True,
                                                  tokenize=False)


def assistant_message(calls: Sequence[ToolCall], content: str = "") -> dict[str, Any]:
    """The assistant turn that made ``calls``: OpenAI's shape, ``arguments`` as objects (what
    chat templates expect: they write them with ``tojson``)."""
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}


def tool_message(call: ToolCall, result: Any) -> dict[str, Any]:
    """The ``role: tool`` message with ``call``'s result (a string as it is, anything else as JSON)."""
    content = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}


def inline_tools(messages: list[dict], specs: Sequence[ToolSpec]) -> list[dict]:
    """``messages`` as plain ``{"role", "content"}`` messages carrying Hermes' tool format as
    Qwen2.5's template writes it: the tool section appended to the system prompt (one is
    added first if there is none and there are specs), each ``tool_calls`` item as a
    ``<tool_call>`` block after the content, each run of ``role: tool`` messages as one user
    message of ``<tool_response>`` blocks."""
    out: list[dict] = []
    previous = None
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant" and message.get("tool_calls"):
            blocks = "".join(f"\n{OPEN}\n{call_json(c)}\n{CLOSE}" for c in message["tool_calls"])
            out.append({"role": "assistant", "content": content + blocks if content else blocks[1:]})
        else:
            out.append({"role": role, "content": content})
        previous = role
    if specs:
        signatures = "".join("\n" + json.dumps(s.to_openai(), ensure_ascii=False) for s in specs)
        section = TOOLS_INTRO + signatures + TOOLS_OUTRO
        if out and out[0]["role"] == "system":
            out[0]["content"] += section
        else:
            out.insert(0, {"role": "system", "content": section.lstrip("\n")})
    return out


def call_json(tool_call: dict[str, Any]) -> str:
    """One ``tool_calls`` item as Hermes' JSON ``{"name": ..., "arguments": {...}}``.

    Raises:
        ValueError: ``arguments`` is a string that is not JSON.
    """
    fn = tool_call.get("function", tool_call)
    return json.dumps({"name": fn["name"], "arguments": arguments_of(fn)}, ensure_ascii=False)


def object_arguments(message: dict) -> dict:
    """``message`` with each ``tool_calls`` item's ``arguments`` as an object (a copy where
    one was a JSON string; the message itself otherwise).

    Raises:
        ValueError: ``arguments`` is a string that is not JSON.
    """
    calls = message.get("tool_calls") or []
    if not any(isinstance(c.get("function", c).get("arguments"), str) for c in calls):
        return message
    fixed = [{**c, "function": {**c["function"], "arguments": arguments_of(c["function"])}} if "function" in c
             else {**c, "arguments": arguments_of(c)} for c in calls]
    return {**message, "tool_calls": fixed}


def arguments_of(fn: dict[str, Any]) -> Any:
    """A function call's ``arguments`` as an object: a JSON string decoded, None as ``{}``.

    Raises:
        ValueError: a string that is not JSON.
    """
    args = fn.get("arguments") or {}
    return json.loads(args) if isinstance(args, str) else args


CHOICES = ("auto", "none", "required")
"""``tool_choice`` values that name no tool (OpenAI's)."""


def forced_prefix(choice: str) -> str:
    """The text a reply is made to start with for ``tool_choice`` (prefilled after the
    generation prompt, so the model can only go on with a call): ``required`` opens a call
    block and its ``name``; a tool's name also writes the name and opens the arguments
    object (left to write the arguments' value from scratch, Qwen2.5-Coder-0.5B wrote
    ``"arguments": 5`` for a five-minute timer); ``auto``/``none``: ''. The format is
    Qwen2.5's (``<tool_call>``, a newline, the JSON object)."""
    if choice in ("auto", "none"):
        return ""
    if choice == "required":
        return OPEN + '\n{"name": "'
    return OPEN + "\n" + json.dumps({"name": choice})[:-1] + ', "arguments": {'


def has_tool_messages(messages: Sequence[dict]) -> bool:
    """Whether any message is a ``role: tool`` result or an assistant turn with ``tool_calls``
    (such a conversation needs :func:`tool_prompt` even with no tool offered now)."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def wire_message(message: dict) -> dict:
    """``message`` as OpenAI's wire has it: each ``tool_calls`` item's ``arguments`` a JSON
    string (a copy where one was an object; the message itself otherwise)."""
    calls = message.get("tool_calls") or []
    if all(isinstance(c.get("function", {}).get("arguments"), str) for c in calls):
        return message
    fixed = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"].get("arguments") or {},
                                                                         ensure_ascii=False)}}
             if not isinstance(c.get("function", {}).get("arguments"), str) else c for c in calls]
    return {**message, "tool_calls": fixed}


def openai_tool_choice(choice: str) -> str | dict[str, Any]:
    """``tool_choice`` as OpenAI's API takes it: ``auto``/``none``/``required`` as they are, a
    tool's name as ``{"type": "function", "function": {"name": ...}}``."""
    return choice if choice in CHOICES else {"type": "function", "function": {"name": choice}}


def call_block(name: str, arguments: Any) -> str:
    """One call as the text of a reply (Hermes' block, as Qwen2.5 writes it): how a call that
    arrived structured (a remote server's ``tool_calls``) joins the one text format the
    readers parse. ``arguments``: an object, or a string as the server sent it (kept as
    it is when it is not JSON, so validation reports it)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE}'
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def demo_exchange(specs: Sequence[ToolSpec]) -> tuple[str, str] | None:
    """A worked example for the few-shot exchanges: the first offered tool's
    :attr:`~pipeline.tools.types.ToolSpec.example` as (what the person says, the call block
    the model answers with); None when no offered tool has one."""
    for spec in specs:
        if spec.example is not None:
            utterance, arguments = spec.example
            return utterance, call_block(spec.name, arguments)
    return None
