"""Errors shared by every room of the pipeline: the refusal a stage, the admission check or a
remote replica raises when it lacks capacity. It sits below the stages, the serving policies
and the worker, so each of them may raise it and the session and the server may catch it."""

from __future__ import annotations

from typing import Literal

BusyReason = Literal["queue", "memory", "sessions", "stage", "ladder", "breaker", "rate_limited"]
"""Why work was refused: ``queue`` (the predicted time to first audio would miss the latency
SLO), ``memory`` (the LLM's memory budget is full), ``sessions`` (the server's session
cap), ``stage`` (a stage's bounded queue is full), ``ladder`` (a stage ran out of memory
twice: the out-of-memory ladder's step 2 refuses new turns), ``breaker`` (a stage's circuit
breaker is open: it failed or was slow too often), ``rate_limited`` (a client's request rate
is over its limit)."""


class Busy(RuntimeError):
    """Work refused for lack of capacity: the caller tells the client ``busy`` and moves on.

    Args:
        message: what was full, for people.
        reason: why (:data:`BusyReason`); ``stage``, a bounded queue is full, by default.
        retry_after_ms: when a retry may succeed (ms).
    """

    def __init__(self, message: str, *, reason: BusyReason = "stage", retry_after_ms: int = 1000) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_ms = retry_after_ms


__all__ = ["Busy", "BusyReason"]
