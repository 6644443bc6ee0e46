"""Messages between the front end and the stage replicas (no ray import here)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from pipeline.serving.types import StageLoad

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
        load: its engine's :class:`~pipeline.serving.types.StageLoad` (``engine.load()``).
        multilingual: ASR only: the model decodes more than English.
        languages: ASR only: ISO codes it decodes.
        at: the replica's ``time.time()`` when it answered (s).
    """

    replica: str
    replicas: int = 1
    load: StageLoad = field(default_factory=StageLoad)
    multilingual: bool = False
    languages: list[str] = field(default_factory=lambda: ["en"])
    at: float = 0.0


@dataclass(slots=True, frozen=True)
class DeploymentLoad:
    """A stage deployment's load over its live replicas (the front end's cached view).

    ``load`` sums the replicas' :class:`ReplicaStats` loads over those heard from recently,
    scaled up to the deployment's replica count when some were not heard from (their load
    is taken to be the mean of the others'); its ``step_ms`` is the mean. Zero everywhere
    until the first answer.

    Attributes:
        replicas: the deployment's replica count (the largest reported, at least those heard).
        load: the summed :class:`~pipeline.serving.types.StageLoad`.
    """

    replicas: int = 0
    load: StageLoad = field(default_factory=StageLoad)

    @staticmethod
    def of(stats: list[ReplicaStats]) -> DeploymentLoad:
        """The sum over ``stats`` (one entry per replica)."""
        if not stats:
            return DeploymentLoad()
        n = max(max(s.replicas for s in stats), len(stats))
        scale = n / len(stats)
        summed = {f.name: round(sum(getattr(s.load, f.name) for s in stats) * scale)
                  for f in fields(StageLoad) if f.name != "step_ms"}
        step_ms = sum(s.load.step_ms for s in stats) / len(stats)
        return DeploymentLoad(replicas=n, load=StageLoad(**summed, step_ms=step_ms))
