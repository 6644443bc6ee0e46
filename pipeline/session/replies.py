"""A session's replies: at most one current reply, started, promoted or cancelled.

Each reply is a :class:`~pipeline.session.responder.Responder` running in a task the session
owns. The current one is what ``response.cancel``, barge-in and a new turn cancel; a
speculative reply (see :mod:`pipeline.session.speculation`) runs before it becomes current.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline import metrics
from pipeline.config import VoxpipeConfig
from pipeline.engines import Engines
from pipeline.errors import Busy
from pipeline.serving.admission import ServiceTimes
from pipeline.serving.governor import Governor
from pipeline.session import events as ev
from pipeline.session.history import ChatHistory
from pipeline.session.responder import Responder
from pipeline.session.tools import SessionTools
from pipeline.session.turn_state import TurnState
from pipeline.session.types import Outbox, TurnHooks

logger = logging.getLogger(__name__)


BUSY_JITTER = 0.25
"""A ``busy`` event's ``retry_after_ms`` is the refusal's value × uniform(1, 1 + this), so
the clients refused in one burst do not all retry at the same moment."""
_jitter = random.Random()


def jittered_retry_ms(retry_after_ms: int) -> int:
    """``retry_after_ms`` spread over [×1, ×(1 + :data:`BUSY_JITTER`)], a whole number of ms,
    never below the policy's value."""
    return max(retry_after_ms, round(retry_after_ms * _jitter.uniform(1.0, 1.0 + BUSY_JITTER)))


async def send_busy(out: Outbox, exc: Busy, *, turn_id: int) -> None:
    """Tell the client its turn ``turn_id`` was refused (a ``busy`` event with a jittered
    ``retry_after_ms``, counted by reason)."""
    metrics.ADMISSIONS.labels("refused", exc.reason).inc()
    await out.send(ev.Busy(turn_id=turn_id, reason=exc.reason, retry_after_ms=jittered_retry_ms(exc.retry_after_ms),
                           message=str(exc)))


CANCEL_WAIT_S = 2.0
"""Longest wait for a cancelled reply to wind down before the session moves on (s)."""


@dataclass(slots=True)
class Reply:
    """One reply: its responder, the task running it and the turn it answers.

    Attributes:
        acks: backchannels the user spoke over it ("yeah"): the history keeps them after it
            if it completes, and forgets them if it is cancelled.
        completed: it ended with ``response.done``.
        cut: it was cut after that, while its client still played it (:meth:`Replies.cut_playing`).
    """

    responder: Responder
    task: asyncio.Task | None = None
    turn_id: int = 0
    acks: list[str] = field(default_factory=list)
    completed: bool = False
    cut: bool = False

    @property
    def rid(self) -> int:
        """The response id."""
        return self.responder.rid

    @property
    def running(self) -> bool:
        """Its task was started and has not ended."""
        return self.task is not None and not self.task.done()

    def cancel(self) -> None:
        """Cancel its task, and abort its LLM request now rather than when the task next
        runs (:meth:`Responder.abort_request`). Idempotent."""
        self.responder.abort_request()
        if self.task is not None:
            self.task.cancel()


class Replies:
    """The replies of one session.

    Args:
        engines, cfg, history: what a :class:`Responder` needs.
        out: the session's outbox.
        turn_state: told when a reply starts, becomes audible and ends.
        spawn: starts a task the session owns (cancelled when it closes).
        session_id: for logs.
        times: admission's service times, fed by the replies. governor: the service level
            (see :class:`Responder`).
    """

    def __init__(self, *, engines: Engines, cfg: VoxpipeConfig, out: Outbox, history: ChatHistory,
                 turn_state: TurnState, spawn: Callable[..., asyncio.Task], session_id: str,
                 times: ServiceTimes | None = None, governor: Governor | None = None,
                 tools: SessionTools | None = None) -> None:
        self.engines, self.cfg, self.out, self.history = engines, cfg, out, history
        self.tools = tools
        self.governor = governor
        self.times = times
        self.turn_state, self._spawn, self.id = turn_state, spawn, session_id
        self.output_rate = 24000  # reply audio rate (Hz), set by session.start
        self.voice: str | None = None  # the voice session.start chose (None: each turn's language picks)
        self.language: str | None = None  # session.start's language: a turn's when it has none
        self.current: Reply | None = None
        self._next_rid = 0
        self._tail: Reply | None = None  # the latest current reply that completed (see playing_tail)

    def playing_tail(self) -> Reply | None:
        """The latest reply that completed (``response.done``) while its client still plays
        it — its audio is sent up to ``playback_lead_s`` ahead of real-time playback, so a
        short reply is all sent before it is heard (:meth:`Responder.played_by`) — with no
        reply current since; else None. Speech then is over that reply, as over one still
        being sent: a backchannel leaves it alone instead of becoming a turn."""
        tail = self._tail
        if tail is None or self.current is not None:
            return None
        until = tail.responder.played_by()
        if until is None or time.perf_counter() >= until:
            self._tail = None
            return None
        return tail

    def busy(self) -> bool:
        """True while the current reply runs."""
        return self.current is not None and self.current.running

    def new(self, *, out: Outbox | None = None, release: asyncio.Event | None = None) -> Reply:
        """A reply (not yet running nor current) that sends to ``out`` (default: the
        session's outbox) and, if ``release`` is given, holds its audio until it is set."""
        self._next_rid += 1
        self._tail = None
        out = out or self.out

        async def error(code: ev.ErrorCode, message: str) -> None:
            metrics.ERRORS.labels(code).inc()
            await out.send(ev.Error(code=code, message=message, fatal=False))

        return Reply(Responder(rid=self._next_rid, engines=self.engines, cfg=self.cfg, out=out,
                               history=self.history, output_rate=self.output_rate, error=error,
                               on_audio_start=self.turn_state.audio_started, release=release,
                               times=self.times, governor=self.governor, session_id=self.id, tools=self.tools))

    def run(self, reply: Reply, user_text: str, *, turn_id: int, t_end: float, asr_ms: float,
            hooks: TurnHooks | None = None, language: str | None = None) -> None:
        """Start ``reply``'s task, answering turn ``turn_id`` (spoken in ``language``, an ISO
        code; None: the session's), telling ``hooks`` when its LLM request was submitted, its
        first audio went out and it ended. The reply's voice is the session's own, else the
        one for the turn's language (:meth:`~pipeline.tts.catalogue.VoiceCatalogue.choose`);
        the LLM is asked to answer in that language
        (:func:`~pipeline.session.language.with_instruction`)."""
        reply.turn_id = turn_id
        language = language or self.language
        reply.responder.voice = self.engines.voices.choose(self.voice, language)
        reply.responder.hooks = hooks = hooks or TurnHooks()
        reply.task = self._spawn(self._run(reply, user_text, t_end, asr_ms, language))
        if hooks.on_end is not None:  # also when the task is cancelled before it ever ran
            on_end = hooks.on_end
            reply.task.add_done_callback(lambda _task: on_end())

    async def begin(self, user_text: str, *, turn_id: int, t_end: float, asr_ms: float,
                    hooks: TurnHooks | None = None, language: str | None = None) -> None:
        """Cancel the current reply and answer ``user_text`` (turn ``turn_id``, in
        ``language``: see :meth:`run`) with a new current one."""
        await self.cancel()
        reply = self.new()
        self.turn_state.reply_started()
        self.run(reply, user_text, turn_id=turn_id, t_end=t_end, asr_ms=asr_ms, hooks=hooks, language=language)
        self.current = reply

    async def promote(self, reply: Reply) -> None:
        """Make a reply that already runs (a confirmed speculation) the current one."""
        await self.cancel()
        self.current = reply
        self.turn_state.reply_started()

    def queued(self, *others: Reply | None) -> int:
        """How many of the current reply and ``others`` (a speculation's) have their LLM
        request waiting in the LLM's queue (:attr:`Responder.queued`): this session's own
        work, which a new turn's reply replaces."""
        replies = {id(r): r for r in (self.current, *others) if r is not None}
        return sum(r.responder.queued for r in replies.values())

    def settle(self, reply: Reply) -> None:
        """``reply`` ended: it is no longer current (if it completed, its client may still
        play it: :meth:`playing_tail`)."""
        if self.current is reply:
            self.current = None
            self.turn_state.reply_ended()
            if reply.completed:
                self._tail = reply

    async def cancel(self, reason: ev.CancelReason = "new_turn") -> None:
        """Cancel the current reply, if it runs, and send ``response.cancelled`` if its
        ``response.started`` went out.
        ``reason``: ``client`` (response.cancel), ``barge_in``, ``continued`` (the user
        went on with the same turn), ``new_turn`` or ``restart`` (a new session.start)."""
        reply, self.current, self._tail = self.current, None, None
        if reply is None or reply.task is None or reply.task.done():
            return
        task = reply.task
        reply.cancel()
        # Wait for the reply to wind down, but never let a stuck reply stall the session.
        done, _ = await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
        if not done:
            logger.warning("session %s: reply %d did not stop within %.1f s", self.id, reply.rid, CANCEL_WAIT_S)
            for frame in task.get_stack():
                logger.warning("  at %s:%d %s", frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        self.turn_state.reply_ended()
        if not reply.responder.started:  # no response.started went out: nothing to close
            return
        spoken = " ".join(reply.responder.spoken).strip()
        await self.out.send(ev.ResponseCancelled(response_id=reply.rid, spoken_text=spoken, reason=reason))

    async def cut_playing(self, reply: Reply, reason: ev.CancelReason) -> bool:
        """``reply`` completed (``response.done`` went out) but its client still plays its
        last audio, sent up to ``playback_lead_s`` ahead (:meth:`Responder.played_by`): send
        ``response.cancelled`` for it after all, so the client stops it; True if sent (once
        per reply). Speech over it whose words are decoded a second or more after it began
        (over a reply's last seconds; after the reply was resumed) would otherwise leave it
        playing to its end. The history keeps the whole reply, as it keeps all the audio
        sent of a reply cancelled while running."""
        until = reply.responder.played_by()
        if not reply.completed or reply.cut or until is None or time.perf_counter() >= until:
            return False
        reply.cut = True
        spoken = " ".join(reply.responder.spoken).strip()
        logger.info("session %s: reply %d cut %.2f s before its client's end (%s)", self.id, reply.rid,
                    until - time.perf_counter(), reason)
        await self.out.send(ev.ResponseCancelled(response_id=reply.rid, spoken_text=spoken, reason=reason))
        return True

    def stop(self) -> None:
        """Session teardown: cancel the current reply's task, sending nothing."""
        reply, self.current = self.current, None
        if reply is not None:
            reply.cancel()

    async def _run(self, reply: Reply, user_text: str, t_end: float, asr_ms: float, language: str | None) -> None:
        try:
            await reply.responder.run(user_text, t_end=t_end, asr_ms=asr_ms, language=language)
            reply.completed = True
            for ack in reply.acks:  # the user's acknowledgements of it, after it
                self.history.add_turn(ack, "")
        except Busy as exc:  # raised before response.started: the turn is refused, nothing is open
            await send_busy(reply.responder.out, exc, turn_id=reply.turn_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("session %s: reply failed", self.id)
            await reply.responder.error("reply_failed", f"reply failed: {exc}")
            if reply.responder.started:  # every started response ends with done or cancelled
                spoken = " ".join(reply.responder.spoken).strip()
                await reply.responder.out.send(ev.ResponseCancelled(response_id=reply.rid, spoken_text=spoken,
                                                                    reason="error"))
        finally:
            self.settle(reply)
