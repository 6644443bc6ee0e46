"""Types shared by the serving policies (admission, the out-of-memory ladder, breakers,
SLO adaptation), the stages they watch and the sessions that follow them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


@dataclass(slots=True, frozen=True)
class StageLoad:
    """One consistent snapshot of a model stage's load (``stage.load()``): what admission
    (:class:`~pipeline.serving.admission.Load`), the metrics and the Ray replicas' stats read.
    A field that does not apply to a stage is 0 (ASR and TTS have no batch slots or KV cache).

    Attributes:
        depth: requests waiting in the stage's queue (the LLM's: waiting for a batch slot,
            aborted ones left out).
        urgent_depth: those waiting at the most urgent priority (0): what a latency-critical
            request (a final transcript, a reply's first phrase) queues behind. Every LLM
            request is a reply someone waits for: the LLM's equals ``depth``.
        active: LLM requests in the batch now (decoding or prefilling).
        slots: the LLM batch's size (requests served at once).
        kv_reserved: KV-cache tokens the LLM batch's requests may hold (prompt + max new
            tokens each, and the cached blocks they started from).
        kv_budget: the LLM's KV-cache budget (tokens).
        step_ms: the LLM's time per engine step now (ms; 0 before the first is measured).
    """

    depth: int = 0
    urgent_depth: int = 0
    active: int = 0
    slots: int = 0
    kv_reserved: int = 0
    kv_budget: int = 0
    step_ms: float = 0.0


@dataclass(slots=True, frozen=True)
class TurnPolicy:
    """How the next reply is made, as the service level allows (:meth:`Governor.turn_policy`).

    Attributes:
        max_new_tokens: the reply's token limit.
        context_tokens: the prompt's token budget (system prompt + history + the user's
            turn + the reply's tokens), counted with the chosen model's tokenizer.
        fallback: generate with the fallback model (if it is loaded; else the main one).
        stock_line: speak this instead of asking any LLM (None: ask one).
        reasons: why it differs from normal service (empty: it does not), for logs.
    """

    max_new_tokens: int
    context_tokens: int
    fallback: bool = False
    stock_line: str | None = None
    reasons: tuple[str, ...] = ()


class Condition(BaseModel):
    """One degradation in force (see docs/PROTOCOL.md, "Degraded service")."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_serialization_defaults_required=True)
    source: Literal["ladder", "breaker", "slo"] = Field(
        description="ladder: a stage ran out of memory; breaker: a stage's circuit breaker is not closed; "
                    "slo: the server adapts to a voice-to-voice p95 over its SLO")
    stage: Literal["asr", "llm", "tts"] | None = Field(description="the stage concerned (None for slo)")
    level: str = Field(description="ladder step 1-3, breaker state open | half_open, slo level 1-2")
    effect: str = Field(description="what users get meanwhile, in plain words")
