"""Speech over the assistant's reply: carry out :class:`~pipeline.session.barge_in.BargeIn`'s
decisions on the session's replies (pause, resume, cancel), with their events
(``response.paused``, ``response.resumed``), metrics and the history of acknowledgements.

The turn runner tells it when speech starts and ends, the session when a partial transcript
comes, the turn's work when its final transcript is decoded. It keeps, per speech turn spoken
over a reply, which reply that was: a backchannel is kept in the history after that reply, if
the reply completes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from pipeline import metrics
from pipeline.config import TurnConfig
from pipeline.session import events as ev
from pipeline.session.backchannel import Backchannels, Heard
from pipeline.session.barge_in import BargeIn
from pipeline.session.echo_guard import ECHO_LAG_S, is_echo
from pipeline.session.history import ChatHistory
from pipeline.session.replies import Replies, Reply
from pipeline.session.turn_state import TurnState
from pipeline.session.types import BargeAction

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Over:
    """A speech turn spoken over ``reply``: its speech's length (ms, once it ended) and its
    outcome (the ``voxpipe_barge_ins_total`` label, once counted)."""

    reply: Reply
    speech_ms: float = 0.0
    outcome: str | None = None


class Interruptions:
    """One session's barge-in handling.

    Args:
        cfg: turn settings (``barge_in_min_ms``, ``backchannels`` and its limits, ``resume_after_ms``).
        replies: the session's replies (the current one is what speech goes over).
        turn_state: whose turn it is (``interrupting``, ``reply_audible``).
        history: the chat history (a completed reply's acknowledgements).
        spawn: starts a task the session owns (the resume timer).
        clock: seconds (``time.monotonic``).

    Attributes:
        policy: the decisions.
    """

    def __init__(self, *, cfg: TurnConfig, replies: Replies, turn_state: TurnState, history: ChatHistory,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = BargeIn(cfg, Backchannels.from_config(cfg) if cfg.backchannels else None)
        self.replies, self.turn_state, self.history = replies, turn_state, history
        self._spawn, self._clock = spawn, clock
        self._over: weakref.WeakKeyDictionary[object, _Over] = weakref.WeakKeyDictionary()
        self._paused: Reply | None = None  # the reply paused, while it is
        self._timer: asyncio.Task | None = None

    def holds_continuation(self, turn: object) -> bool:
        """Speech that would continue speech turn ``turn`` must first prove to be words: the
        policy is on and a reply is audible (being sent, or all sent and still playing at the
        client: :meth:`Replies.playing_tail`), or ``turn`` was itself spoken over the current
        reply (continuing it at once would cancel a reply it did not ask for). Else it
        continues the turn at once, as always."""
        over = self._over.get(turn)
        return self.policy.on and (self.turn_state.reply_audible or self.replies.playing_tail() is not None
                                   or (over is not None and over.reply is self.replies.current))

    def continues_with(self, turn: object, text: str, language: str | None) -> bool:
        """Speech turn ``turn``, held back from continuing the latest turn
        (:meth:`holds_continuation`) and ended before a partial transcript decided, said
        ``text`` (its final transcript): True when those are words (not a backchannel) and the
        reply it was spoken over is still the current one and running, or completed meanwhile
        with no reply after it (its audio all sent while the user went on: the client is
        still playing it) — the caller continues the latest turn with it after all. A reply
        cancelled or replaced meanwhile leaves the words a turn of their own."""
        over = self._over.get(turn)
        if over is None:
            return False
        reply, current = over.reply, self.replies.current
        spoken_over = (reply is current and reply.running) or (current is None and reply.completed)
        return (spoken_over and self.policy.classify(text, over.speech_ms, language) == "words"
                and not self._echo(reply, text, over.speech_ms))

    def spoken_over(self, turn: object) -> bool:
        """Speech turn ``turn`` began over a reply and no partial has decided it yet (words
        that cancelled the reply make it a turn like any other)."""
        over = self._over.get(turn)
        return over is not None and over.outcome is None

    def forget(self, turn: object) -> None:
        """Speech turn ``turn`` is continued by words: it is no longer a turn over a reply."""
        self._over.pop(turn, None)

    # ---- speech ------------------------------------------------------------------------

    async def speech_started(self, turn: object) -> None:
        """Speech turn ``turn`` began (after :meth:`TurnState.speech_started`): over a reply it
        is a candidate, and an audible reply may be paused."""
        if self._paused is not None and self._paused is not self.replies.current:
            self._forget_pause()  # it ended meanwhile (a new turn, response.cancel)
        ts, reply = self.turn_state, self.replies.current
        tail = self.replies.playing_tail() if not ts.interrupting else None  # all sent, still playing
        over = (ts.interrupting and reply is not None) or tail is not None
        if tail is not None:
            reply = tail
        if over and reply is not None:
            self._over[turn] = _Over(reply)
        action = self.policy.speech_started(self._ms(), replying=over, audible=ts.reply_audible and tail is None)
        if action is BargeAction.PAUSE and reply is not None:
            await self._pause(reply)

    def words_cancel(self, text: str, speech_ms: float, language: str | None, *,
                     voiced_ms: float | None = None) -> bool:
        """A partial transcript of the speech in progress (``speech_ms`` long so far,
        ``voiced_ms`` of it voiced): True when its words cancel the reply (the caller cancels
        it, :meth:`cancel`, or continues the turn it answers). The words the reply was
        playing meanwhile (its echo) never do."""
        if self._echo(self.replies.current or self.replies.playing_tail(), text, speech_ms):
            return False
        return self.policy.partial(text, speech_ms, language, voiced_ms=voiced_ms) is BargeAction.CANCEL

    async def cancel(self, turn: object, reason: ev.CancelReason = "barge_in") -> None:
        """Words over the reply (speech turn ``turn``'s): cancel it (``barge_in``), or only
        count it when the caller cancels it itself (``continued``)."""
        over = self._over.get(turn)
        self._count(turn, "cancelled" if reason == "barge_in" else reason)
        self._forget_pause()
        if reason == "barge_in":
            self.turn_state.barge_in()
            await self.replies.cancel("barge_in")
        if over is not None:  # all sent while the speech went on: the client may still play it
            await self.replies.cut_playing(over.reply, reason)

    async def speech_ended(self, turn: object | None, *, speech_ms: float, submitted: bool) -> None:
        """The speech ended (``speech_ms`` long); ``submitted``: its final transcript will be
        decoded (else a paused reply resumes now)."""
        over = self._over.get(turn) if turn is not None else None
        if over is not None:
            over.speech_ms = speech_ms
        if self.policy.speech_ended(submitted=submitted) is BargeAction.RESUME:
            await self._resume()
        if not submitted and turn is not None:
            self._count(turn, "ignored")
            self._over.pop(turn, None)

    async def final(self, turn: object, text: str, language: str | None) -> Heard | None:
        """Speech turn ``turn``'s final transcript ``text``: None if it was not spoken over a
        reply; else what it said, after carrying out the decision (words cancel a paused
        reply; no words or a backchannel resume it). A backchannel is the user's
        acknowledgement of the reply: kept in the history after the reply if it completes."""
        over = self._over.pop(turn, None)
        if over is None:
            return None
        if over.outcome in ("cancelled", "continued"):  # its partial's words already did
            return "words"
        echo = self._echo(over.reply, text, over.speech_ms)  # the reply's own voice, back through a microphone
        heard, action = self.policy.final("" if echo else text, over.speech_ms, language)
        if echo:
            heard = "echo"
            metrics.ECHO_IGNORED.inc()
            logger.info("reply %d: the speech over it was its own echo (%r): ignored", over.reply.rid, text[:80])
        if action is BargeAction.CANCEL and over.reply is self.replies.current:
            self._count(turn, "cancelled", over)
            self._forget_pause()
            await self.replies.cancel("barge_in")
        elif heard == "words" and await self.replies.cut_playing(over.reply, "barge_in"):
            self._count(turn, "cancelled", over)  # a short word over its last audio (no partial came)
        elif action is BargeAction.RESUME and await self._resume():
            self._count(turn, "resumed", over)  # popped above: _resume's loop cannot see it
        if heard == "backchannel":
            metrics.BACKCHANNELS_IGNORED.inc()
            if over.reply.running:
                over.reply.acks.append(text)
            elif over.reply.completed:
                self.history.add_turn(text, "")
        self._count(turn, "new_turn" if heard == "words" else "ignored", over)
        return heard

    def reset(self) -> None:
        """``session.start`` again: the speech in progress and every turn over a reply are
        forgotten (the reply was cancelled)."""
        self._forget_pause()
        self.policy.speech_ended(submitted=True)
        self._over.clear()

    # ---- the paused reply ----------------------------------------------------------------

    async def _pause(self, reply: Reply) -> None:
        if not reply.running or not reply.responder.pause():
            self.policy.forget_pause()
            return
        self._paused = reply
        await reply.responder.out.send(ev.ResponsePaused(response_id=reply.rid, reason="speech"))
        self._timer = self._spawn(self._resume_when_due())

    async def _resume_when_due(self) -> None:
        await asyncio.sleep(self.policy.resume_ms / 1000)
        self._timer = None  # this task is ending: _resume must not cancel it
        if self.policy.due(self._ms()) is BargeAction.RESUME:
            await self._resume()

    async def _resume(self) -> bool:
        """Resume the paused reply, if any; True if one resumed."""
        reply, self._paused = self._paused, None
        self._stop_timer()
        if reply is None:
            return False
        paused_s = reply.responder.resume()
        if paused_s is None or not reply.running:
            return False
        metrics.FALSE_INTERRUPTIONS.inc()
        for turn, over in list(self._over.items()):
            if over.reply is reply:
                self._count(turn, "resumed", over)
        await reply.responder.out.send(ev.ResponseResumed(response_id=reply.rid, paused_ms=round(paused_s * 1000)))
        return True

    def _forget_pause(self) -> None:
        self.policy.forget_pause()
        self._paused = None
        self._stop_timer()

    def _stop_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _count(self, turn: object, outcome: str, over: _Over | None = None) -> None:
        """Count speech turn ``turn``'s outcome over the reply, once."""
        over = over or self._over.get(turn)
        if over is not None and over.outcome is None:
            over.outcome = outcome
            metrics.BARGE_INS.labels(outcome).inc()

    @staticmethod
    def _echo(reply: Reply | None, text: str, speech_ms: float) -> bool:
        """``text``, heard over ``reply`` in speech ``speech_ms`` long until now, is the echo
        of what the reply was playing meanwhile (:func:`~pipeline.session.echo_guard.is_echo`)."""
        if reply is None or not text:
            return False
        now = time.perf_counter()
        return is_echo(text, reply.responder.playing_between(now - speech_ms / 1000 - ECHO_LAG_S, now))

    def _ms(self) -> float:
        return self._clock() * 1000
