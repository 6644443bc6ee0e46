"""What ``voxpipe bench turns`` makes of one case's wire events (:class:`CaseLog`): a
:class:`CaseResult`, then per server configuration and class a table row. Pure: no I/O.

Definitions (all times are the client's ``perf_counter``, s; "true end" is when the frame
holding the user's last speech sample was sent, :attr:`CaseLog.true_end`):

- premature end of turn: reply audio arrived before the true end;
- ended in the pause: a ``speech.stopped`` whose ``audio_ms`` lies before the speech that
  follows the pause (class ``pause``);
- end-of-turn delay: arrival of the ``speech.stopped`` of the user's last speech (the last
  one received whose ``audio_ms`` is past the start of that speech and before any burst)
  minus the true end;
- voice-to-voice: the first audio of the first reply whose audio began after the true end,
  minus the true end; that reply is *the* reply;
- with a burst: the reply is *lost* when ``response.cancelled`` came for it after the burst
  started, or it was paused (``response.paused``) and not resumed by the end of the case; a
  reply whose ``response.done`` came before the burst started is not counted (it could no
  longer be stopped); stop latency (class ``interruption``): the first ``response.paused``
  or ``response.cancelled`` of the reply minus when the interruption's first word was sent.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CaseLog:
    """What the client saw in one case. ``events``: (arrival s, event) for every JSON event;
    ``audio``: per ``response_id``, the arrival of its first and latest binary frame (s)."""

    cls: str
    name: str
    true_end: float | None = None  # when the user's true end of speech was sent
    last_start_ms: float = 0.0  # stream position where the user's last stretch of speech starts
    pause_end_ms: float | None = None  # stream position where the pause ends (class pause)
    burst_start: float | None = None  # when the burst's first frame was sent
    burst_pos_ms: float | None = None  # its stream position
    burst_word: float | None = None  # when the interruption's first word was sent
    events: list[tuple[float, dict]] = field(default_factory=list)
    audio: dict[int, list[float]] = field(default_factory=dict)
    error: str | None = None  # an exception's name: the case did not finish


@dataclass(slots=True)
class CaseResult:
    """One case's measures (ms; None: not applicable or not seen)."""

    cls: str
    name: str
    outcome: str  # "answered" | "busy" | "empty" | "no reply" | "error"
    premature: bool = False
    ended_in_pause: bool = False
    eot_delay: float | None = None
    voice_to_voice: float | None = None
    reply_id: int | None = None
    eligible: bool = False  # a burst came while the reply could still be stopped
    lost: bool = False  # the reply was cancelled (or paused for good) after the burst
    cancel_reason: str | None = None
    paused: bool = False
    resumed: bool = False
    stop_latency: float | None = None
    error: str | None = None


def _first(log: CaseLog, kind: str, rid: int) -> float | None:
    return next((t for t, e in log.events if e.get("type") == kind and e.get("response_id") == rid), None)


def the_reply(log: CaseLog) -> int | None:
    """The reply to the user's turn: the first whose audio began after the true end."""
    if log.true_end is None:
        return None
    later = [(ts[0], rid) for rid, ts in log.audio.items() if ts[0] >= log.true_end]
    return min(later)[1] if later else None


def case_result(log: CaseLog) -> CaseResult:
    """Measure one case (module docstring)."""
    res = CaseResult(log.cls, log.name, "error" if log.error else "no reply", error=log.error)
    end = log.true_end
    if end is None:
        return res
    res.premature = any(ts[0] < end for ts in log.audio.values())
    limit = log.burst_pos_ms if log.burst_pos_ms is not None else float("inf")
    stops = [(t, e) for t, e in log.events if e.get("type") == "speech.stopped" and e.get("audio_ms", 0) < limit]
    if log.pause_end_ms is not None:
        res.ended_in_pause = any(e["audio_ms"] <= log.pause_end_ms for _, e in stops)
    last = [t for t, e in stops if e["audio_ms"] > log.last_start_ms]
    if last:
        res.eot_delay = round((last[-1] - end) * 1000, 1)
    rid = res.reply_id = the_reply(log)
    if rid is not None:
        res.outcome, res.voice_to_voice = "answered", round((log.audio[rid][0] - end) * 1000, 1)
    elif any(e.get("type") == "busy" for t, e in log.events if t >= end - 1.0):
        res.outcome = "busy"
    elif any(e.get("type") == "turn.empty" for t, e in log.events if t >= end - 1.0):
        res.outcome = "empty"
    if log.error:
        res.outcome = "error"
    if rid is None or log.burst_start is None:
        return res
    done, cancelled = _first(log, "response.done", rid), _first(log, "response.cancelled", rid)
    paused, resumed = _first(log, "response.paused", rid), _first(log, "response.resumed", rid)
    res.eligible = not (done is not None and done < log.burst_start) and not (
        cancelled is not None and cancelled < log.burst_start)
    if not res.eligible:
        return res
    res.paused, res.resumed = paused is not None, resumed is not None
    res.lost = cancelled is not None or (res.paused and not res.resumed)
    if cancelled is not None:
        res.cancel_reason = next(e.get("reason") for t, e in log.events
                                 if e.get("type") == "response.cancelled" and e.get("response_id") == rid)
    first_stop = min((t for t in (paused, cancelled) if t is not None), default=None)
    if log.cls == "interruption" and first_stop is not None and log.burst_word is not None:
        res.stop_latency = round((first_stop - log.burst_word) * 1000, 1)
    return res


def pct(xs: list[float]) -> tuple[float, float]:
    """(p50, p95) of ``xs``, nearest rank (as ``bench voice``); (nan, nan) when empty."""
    if not xs:
        return float("nan"), float("nan")
    s = sorted(xs)
    return statistics.median(s), s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))]


def summarize(results: list[CaseResult]) -> dict[str, Any]:
    """One (configuration, class) cell: counts, rates (0–1; nan when nothing to count) and
    (p50, p95) pairs in ms."""
    n = len(results)
    answered = [r for r in results if r.outcome == "answered"]
    eligible = [r for r in results if r.eligible]
    stops = [r.stop_latency for r in eligible if r.stop_latency is not None]

    def rate(k: int, d: int) -> float:
        return k / d if d else float("nan")

    return {"cases": n, "answered": len(answered), "busy": sum(r.outcome == "busy" for r in results),
            "errors": sum(r.outcome == "error" for r in results),
            "premature": rate(sum(r.premature for r in results), n),
            "ended_in_pause": rate(sum(r.ended_in_pause for r in results), n),
            "eot_delay": pct([r.eot_delay for r in results if r.eot_delay is not None]),
            "voice_to_voice": pct([r.voice_to_voice for r in answered if r.voice_to_voice is not None]),
            "eligible": len(eligible), "lost": rate(sum(r.lost for r in eligible), len(eligible)),
            "paused": sum(r.paused for r in eligible), "resumed": sum(r.resumed for r in eligible),
            "stop_latency": pct(stops), "stop_within_500": rate(sum(s <= 500 for s in stops), len(eligible))}
