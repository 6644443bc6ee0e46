"""The LLM engine's input processor: a :class:`GenRequest` becomes a :class:`SchedRequest`.

The chat template turns the messages into prompt token ids; the sampling settings are
checked; a request that could never run (over the KV budget, or longer than the model's
context) is refused before it reaches the scheduler. The shape of vLLM v1's input
processor (``Processor.process_inputs``, vllm/v1/engine/processor.py), without its
multi-modal and LoRA parts. Runs on the engine thread (``count_tokens`` from any thread).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from pipeline.llm.types import GenRequest, SamplingParams, SchedRequest
from pipeline.tools.render import forced_prefix, has_tool_messages, template_takes_tools, tool_prompt
from pipeline.tools.types import ToolSpec


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Prompt token ids of chat ``messages`` under a Hugging Face tokenizer's chat template,
    with the generation prompt (``apply_chat_template(..., add_generation_prompt=True)``):
    exactly what the model prefills. A template that returns a ``BatchEncoding`` gives its
    ``input_ids``."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(enc, dict) or hasattr(enc, "keys"):
        enc = enc["input_ids"]
    return list(enc)


def eos_token_ids(tokenizer: Any, generation_config: Any) -> frozenset[int]:
    """Token ids that end a reply: the generation config's ``eos_token_id`` (an id or a list)
    and the tokenizer's ``eos_token_id``; None left out."""
    eos = generation_config.eos_token_id
    return frozenset((eos if isinstance(eos, list) else [eos]) + [tokenizer.eos_token_id]) - {None}


def check_sampling(req: GenRequest) -> None:
    """Raise ValueError for sampling settings that cannot run: ``max_new_tokens`` < 1,
    a temperature that is not a finite number ≥ 0, ``top_p`` outside (0, 1]."""
    if not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer ≥ 1, got {req.max_new_tokens!r}")
    if not (math.isfinite(req.temperature) and req.temperature >= 0):
        raise ValueError(f"temperature must be a finite number ≥ 0, got {req.temperature!r}")
    if not (0 < req.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {req.top_p!r}")


def offered_tools(req: GenRequest) -> tuple[ToolSpec, ...]:
    """The tools ``req`` offers the model (none with ``tool_choice="none"``)."""
    return req.tools if req.tool_choice != "none" else ()


def reply_prefix(req: GenRequest) -> str:
    """The text ``req``'s reply is made to start with (its ``tool_choice`` forcing a call), or ''."""
    return forced_prefix(req.tool_choice) if offered_tools(req) else ""


class InputProcessor:
    """Turns requests into the scheduler's view, numbering them 1, 2, ...

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        eos_ids: token ids that end a reply (:func:`eos_token_ids`).
        kv_budget: the engine's KV-cache budget (tokens): no request may need more.
        context: the model's context (``max_position_embeddings``; None or 0: unbounded).
    """

    def __init__(self, tokenizer: Any, eos_ids: frozenset[int], *, kv_budget: int, context: int | None) -> None:
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.kv_budget, self.context = kv_budget, context
        self._rids = itertools.count(1)
        self._native_tools: bool | None = None  # the template renders tools= (probed at first use)

    def count_tokens(self, messages: list[dict], tools: tuple[ToolSpec, ...] = ()) -> int:
        """Prompt tokens of ``messages`` (with ``tools`` offered) under the model's chat template."""
        return len(self.prompt_ids(messages, tools))

    def prompt_ids(self, messages: list[dict], tools: tuple[ToolSpec, ...] = (), prefix: str = "") -> list[int]:
        """The prompt's token ids: plain messages through :func:`chat_prompt_ids`; with tools
        offered or tool messages in the conversation, through
        :func:`~pipeline.tools.render.tool_prompt` (the template's own tool format when it has
        one); ``prefix`` (:func:`~pipeline.tools.render.forced_prefix`) tokenized after it.

        Raises:
            ValueError: a ``tool_calls`` item whose ``arguments`` string is not JSON.
        """
        if not tools and not has_tool_messages(messages):
            ids = chat_prompt_ids(self.tokenizer, messages)
        else:
            if self._native_tools is None:
                self._native_tools = template_takes_tools(self.tokenizer)
            ids = tool_prompt(self.tokenizer, messages, tools, native=self._native_tools)
        if prefix:
            ids = ids + list(self.tokenizer.encode(prefix, add_special_tokens=False))
        return ids

    def process(self, req: GenRequest) -> SchedRequest:
        """The scheduler's view of ``req``: prompt ids, limits and sampling settings, with
        the next request id.

        Raises:
            ValueError: bad sampling settings (:func:`check_sampling`), a prompt that can
                never fit (:meth:`check_fits`), or malformed tool-call arguments in the messages.
        """
        check_sampling(req)
        ids = self.prompt_ids(req.messages, offered_tools(req), reply_prefix(req))
        self.check_fits(len(ids), req.max_new_tokens)
        return SchedRequest(rid=next(self._rids), prompt_ids=ids, max_new_tokens=req.max_new_tokens,
                            eos_ids=self.eos_ids, owner=req.session, sampling=SamplingParams.of(req),
                            priority=req.priority)

    def check_fits(self, prompt: int, max_new: int) -> None:
        """Raise ValueError if a request of ``prompt`` + ``max_new`` tokens could never run:
        over the KV budget, or longer than the model's context."""
        if prompt + max_new > self.kv_budget:
            raise ValueError(f"prompt of {prompt} tokens + max_new_tokens {max_new} exceeds the KV budget of "
                             f"{self.kv_budget} tokens")
        if self.context and prompt + max_new > self.context:
            raise ValueError(f"prompt of {prompt} tokens + max_new_tokens {max_new} exceeds the model's context "
                             f"of {self.context} tokens")
