"""Ray's exceptions as voxpipe's: what a session already knows how to report.

- Serve's ``BackPressureError`` (a caller's queue for the deployment is full) and a
  replica's :class:`~pipeline.errors.Busy` (its engine's queue is full, its breaker is open)
  become :class:`~pipeline.errors.Busy`, with the replica's reason and retry hint: the
  session sends the same typed ``busy`` event as for an in-process stage.
- A replica that died or cannot be reached (``RayActorError``: ``ActorDiedError``,
  ``ActorUnavailableError``), a request Serve could not route or run, or any error the
  replica raised becomes :class:`~pipeline.remote.types.StageUnavailable`: the session
  reports a typed error for that turn (``asr_failed``, ``reply_failed``, ``tts_failed``)
  and the connection stays open. Serve restarts the replica meanwhile.
"""

from __future__ import annotations

from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException

from pipeline.errors import Busy
from pipeline.remote.types import StageUnavailable

BACKPRESSURE_RETRY_MS = 1000
"""``retry_after_ms`` of a ``busy`` from Serve's back-pressure when Serve gives none."""


def cause_of(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper (``RayTaskError.cause``), or ``exc``."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    return exc


def as_busy(stage: str, exc: BaseException) -> Busy | None:
    """``exc`` as :class:`Busy` when it says the stage is full or refusing (Serve's
    back-pressure, or the replica's own ``Busy``); None otherwise."""
    if isinstance(exc, BackPressureError):
        retry_s = getattr(exc, "_retry_after_s", None)
        retry_ms = round(retry_s * 1000) if isinstance(retry_s, int | float) else BACKPRESSURE_RETRY_MS
        return Busy(f"{stage} is busy: every replica's queue is full ({exc})", retry_after_ms=retry_ms)
    cause = cause_of(exc)
    if isinstance(cause, Busy):
        return Busy(str(cause), reason=getattr(cause, "reason", "stage"),
                    retry_after_ms=getattr(cause, "retry_after_ms", BACKPRESSURE_RETRY_MS))
    return None


def translate(stage: str, exc: BaseException) -> BaseException:
    """The exception a session should see for ``exc``, raised by a call to ``stage``:
    :class:`Busy` (see :func:`as_busy`), :class:`StageUnavailable` for Ray's and Serve's
    own errors and anything the replica raised, or ``exc`` itself when it is not Ray's
    (a bug on this side, cancellation)."""
    busy = as_busy(stage, exc)
    if busy is not None:
        return busy
    if isinstance(exc, RayActorError):
        return StageUnavailable(stage, f"its replica died or is unreachable ({type(exc).__name__}); Serve restarts it")
    if isinstance(exc, RayTaskError):
        cause = cause_of(exc)
        return StageUnavailable(stage, f"{type(cause).__name__}: {cause}")
    if isinstance(exc, RayError | RayServeException):
        return StageUnavailable(stage, f"{type(exc).__name__}: {exc}")
    return exc
