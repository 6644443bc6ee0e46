"""Messages between the front end and the stage replicas (no ray import here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

RemoteStageName = Literal["asr", "llm", "tts"]
"""The Serve deployment of each model stage, by name."""

APP_NAME = "voxpipe"
"""The Serve application that holds the stage deployments."""
INGRESS_NAME = "stages"
"""The application's ingress deployment: a directory of the stages (no model, no CPU)."""
FRONTEND_NAME = "frontend"
"""The WebSocket front end as Serve's ingress (server/ingress.py), in its own application."""


class StageUnavailable(RuntimeError):
    """A remote stage could not serve a call that had started: its replica died or became
    unreachable (``RayActorError`` and kin), the replica raised, or its queue filled up
    after the call was accepted. The session reports it as a typed error for that turn
    (``asr_failed``, ``reply_failed``, ``tts_failed``) and carries on.

    Args:
        stage: ``asr``, ``llm`` or ``tts``.
        message: what happened, for people.
    """

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"{stage} deployment: {message}")
        self.stage = stage


@dataclass(slots=True)
class ReplicaStats:
    """One replica's load, as its ``stats`` method reports it (cheap: counters only).

    Attributes:
        replica: the replica's unique id (Serve's replica tag).
        replicas: how many replicas the deployment has (Serve's ``world_size``).
        depth: requests waiting in the engine's queue.
        urgent_depth: requests waiting at priority 0.
        active: LLM requests in the batch (0 for ASR and TTS).
        slots: the LLM batch's size (0 for ASR and TTS).
        kv_reserved: LLM KV-cache tokens the batch may hold.
        kv_budget: the LLM KV-cache budget (tokens).
        step_ms: the LLM's time per engine step (ms; 0 before the first).
        multilingual: ASR only: the model decodes more than English.
        languages: ASR only: ISO codes it decodes.
        at: the replica's ``time.time()`` when it answered (s).
    """

    replica: str
    replicas: int = 1
    depth: int = 0
    urgent_depth: int = 0
    active: int = 0
    slots: int = 0
    kv_reserved: int = 0
    kv_budget: int = 0
    step_ms: float = 0.0
    multilingual: bool = False
    languages: list[str] = field(default_factory=lambda: ["en"])
    at: float = 0.0


@dataclass(slots=True)
class StageLoad:
    """A stage's load over its live replicas (the front end's cached view).

    Sums of :class:`ReplicaStats` over the replicas heard from recently, scaled up to the
    deployment's replica count when some were not heard from (their load is taken to be
    the mean of the others'); ``step_ms`` is the mean. Zero everywhere until the first
    answer.
    """

    replicas: int = 0
    depth: int = 0
    urgent_depth: int = 0
    active: int = 0
    slots: int = 0
    kv_reserved: int = 0
    kv_budget: int = 0
    step_ms: float = 0.0

    @staticmethod
    def of(stats: list[ReplicaStats]) -> StageLoad:
        """The sum over ``stats`` (one entry per replica)."""
        if not stats:
            return StageLoad()
        n = max(max(s.replicas for s in stats), len(stats))
        scale = n / len(stats)

        def total(name: str) -> int:
            return round(sum(getattr(s, name) for s in stats) * scale)

        return StageLoad(replicas=n, depth=total("depth"), urgent_depth=total("urgent_depth"), active=total("active"),
                         slots=total("slots"), kv_reserved=total("kv_reserved"), kv_budget=total("kv_budget"),
                         step_ms=sum(s.step_ms for s in stats) / len(stats))
