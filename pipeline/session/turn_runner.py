"""Run a speech turn from its speech to its reply: the session's turn logic between the
turn tracker's events and :class:`~pipeline.session.replies.Replies`.

At a pause it speculates (:mod:`pipeline.session.speculation`): the final transcript and
the reply start, held back; speech that resumes drops that. At the end of the speech it
asks admission (:class:`~pipeline.session.gate.TurnGate`) and refuses the turn (``busy``,
then its words: :meth:`TurnRunner._keep_words`) or submits it: a task confirms the
speculation or decodes the final transcript, then starts the reply. Speech that resumes
within the merge window continues the turn (:class:`~pipeline.session.turn_ids.TurnIds`):
its task and reply are cancelled, its words stay. Where the turn stands is a
:class:`~pipeline.session.turn_machine.TurnMachine`; the session's
:class:`~pipeline.session.turn_state.TurnState` is told what happened. Speech over a reply
goes through :class:`~pipeline.session.interruptions.Interruptions` (pause, resume,
cancel, backchannels).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from audio.pcm import RATE
from pipeline import metrics
from pipeline.asr.turn import AsrTurn
from pipeline.config import TurnConfig
from pipeline.session import events as ev
from pipeline.session.gate import CHARS_PER_SPEECH_S, TurnGate
from pipeline.session.history import ChatHistory, Exchange
from pipeline.session.interruptions import Interruptions
from pipeline.session.replies import Replies, send_busy
from pipeline.session.speculation import HeldOutbox, Speculation
from pipeline.session.turn_ids import TurnIds
from pipeline.session.turn_machine import TurnMachine
from pipeline.session.turn_state import TurnState
from pipeline.session.turn_work import TurnWork
from pipeline.session.types import Outbox, SpeechEnd, StageEvent

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Unanswered:
    """A refused speech turn's words: its entry in the history, the task that reports its
    final transcript (and revises the entry with it)."""

    turn: AsrTurn
    entry: Exchange
    task: asyncio.Task | None = None


class TurnRunner:
    """The speech turns of one session.

    Args:
        cfg: turn settings (``end_silence_ms``, ``early_end_ms``).
        out: the client's outbox.
        history: the chat history (its size goes into admission's prompt estimate).
        gate: admission for this session's turns.
        replies: the session's replies.
        turn_state: whose turn it is; told when speech starts and stops and when a
            transcript is done.
        ids: turn ids and the merge window.
        new_asr: a new streaming ASR turn (the session's language and callbacks).
        spawn: starts a task the session owns (cancelled when it closes).
        error: ``error(code, message)`` reports to the client.
        session_id: for logs.

    Attributes:
        machine: where the latest speech turn stands.
        asr: the streaming ASR of the speech in progress (None between speech).
        last: ... of the latest speech turn (speech may continue it).
        barge: speech over the reply (barge-in, backchannels, false-interruption resume).
    """

    def __init__(self, *, cfg: TurnConfig, out: Outbox, history: ChatHistory, gate: TurnGate, replies: Replies,
                 turn_state: TurnState, ids: TurnIds, new_asr: Callable[[], AsrTurn],
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
                 error: Callable[[ev.ErrorCode, str], Awaitable[None]], session_id: str) -> None:
        self.cfg, self.out, self.history, self.gate, self.replies = cfg, out, history, gate, replies
        self.turn_state, self.ids, self._new_asr, self._spawn = turn_state, ids, new_asr, spawn
        self.barge = Interruptions(cfg=cfg, replies=replies, turn_state=turn_state, history=history, spawn=spawn)
        self.work = TurnWork(out=out, replies=replies, gate=gate, ids=ids, turn_state=turn_state, error=error,
                             session_id=session_id, barge=self.barge)
        self.machine = TurnMachine()
        self.session_id = session_id
        self.asr: AsrTurn | None = None
        self.last: AsrTurn | None = None
        self._task: asyncio.Task | None = None  # the latest ended turn's: final ASR (or confirmation), then reply
        self._spec: Speculation | None = None  # while SPECULATING: the speculation of the speech in progress
        self._confirming: Speculation | None = None  # ... handed to the latest submitted turn's task
        self._held: tuple[AsrTurn, int] | None = None  # the turn (and its first sample) the speech may yet continue
        self._unanswered: _Unanswered | None = None  # the latest refused turn's words, while speech may continue it

    # ---- speech ------------------------------------------------------------------------

    async def speech_started(self, start: int, preroll: np.ndarray) -> None:
        """Speech started at sample ``start`` (``preroll``: its audio so far, float32 16 kHz,
        from ``pad_ms`` before it): stream it to the ASR. Speech that resumes soon after the
        latest turn ended continues that turn (its reply is cancelled; its words stay)."""
        turn = self.last if self.last is not None and self.ids.continues(start) else None
        if self.last is not None:
            audio_gap, client_gap = self.ids.gaps(start)
            logger.info("session %s: speech %s the latest turn (%.2f s after it in the audio, %.2f s on the "
                        "client's clock)", self.session_id,
                        "continues" if turn is not None else "does not continue", audio_gap, client_gap)
        # Over an audible reply, speech that would continue the latest turn is a barge-in
        # candidate first, a turn of its own: it continues that turn only once words are heard
        # (words_over_reply); a cough or an "mm-hm" leaves the reply alone.
        held = (turn, self.ids.span[0]) if turn is not None and self.ids.span and self.barge.holds_continuation(turn) \
            else None
        if held is not None:
            turn = None
        turn_id = self.ids.speech_started(start, continues=turn is not None)
        await self.out.send(ev.SpeechStarted(turn_id=turn_id, audio_ms=int(start * 1000 / RATE)))
        self.turn_state.speech_started()  # over a reply: a barge-in candidate until ASR confirms words
        if turn is not None:
            refused = self.machine.refused  # a refused turn goes on: no reply of it to cancel
            self.machine.fire(StageEvent.CONTINUE)
            if refused:
                self._take_back(turn)
            else:
                await self._cancel_answer()
            turn.reopen()
        else:
            self.machine.fire(StageEvent.SPEECH)
            turn = self._new_asr()
        self.asr = self.last = turn
        self._held = held
        turn.feed(preroll)
        self.ids.register(turn, turn_id)
        await self.barge.speech_started(turn)  # over a reply: a candidate (an audible reply pauses)

    async def _cancel_answer(self) -> None:
        """The latest turn goes on: cancel its task, its speculation and its reply."""
        if self._task is not None:
            self._task.cancel()
        spec, self._confirming = self._confirming, None
        if spec is not None and (spec.resp is None or spec.resp is not self.replies.current):
            # its confirmation may be cancelled before it ran: nothing else stops it
            # (nor its decode, whose reply would otherwise start unseen, an orphan)
            spec.drop()
        await self.replies.cancel("continued")

    async def words_over_reply(self, text: str, language: str | None, speech_ms: float, *,
                               voiced_ms: float | None = None) -> None:
        """A partial transcript ``text`` of the speech in progress over a reply (``speech_ms``
        long so far, ``voiced_ms`` of it up to its last voiced window; None: all). If its words
        cancel the reply, cancel it (``barge_in``); or, when this speech was held back from
        continuing the latest turn, continue that turn after all:
        its reply is cancelled (``continued``), this speech's ASR stops and the turn's goes on
        with this speech's audio so far (from ``pad_ms`` before it); the merged turn keeps this
        speech's id. Speech whose audio is no longer all there (its ASR buffer was trimmed)
        is a turn of its own instead."""
        turn = self.asr
        if turn is None or not self.barge.words_cancel(text, speech_ms, language, voiced_ms=voiced_ms):
            return
        held, self._held = self._held, None
        audio = turn.stream.audio() if held is not None else None
        if held is None or audio is None:
            await self.barge.cancel(turn, "barge_in")
            return
        await self.barge.cancel(turn, "continued")
        await self._cancel_answer()
        turn.close()
        self._join(turn, held, audio)
        self.asr = held[0]

    def _join(self, turn: AsrTurn, held: tuple[AsrTurn, int], audio: np.ndarray) -> None:
        """Speech turn ``turn`` continues the earlier turn ``held`` (it and its first sample)
        after all: that turn goes on with ``audio`` (``turn``'s, float32 16 kHz) under
        ``turn``'s id and is the latest speech turn."""
        old, old_start = held
        self._take_back(old)
        self.barge.forget(old)
        self.barge.forget(turn)
        old.reopen()
        old.feed(audio)
        turn_id = self.ids.of(turn)
        self.ids.join(old, turn_id)
        if self.ids.speech_id == turn_id:
            self.ids.rejoin(old_start)
        if self.last is turn:
            self.last = old

    async def speech_ended(self, end: SpeechEnd, *, t_end: float, drop_tail: int, waited_ms: float = 0.0) -> None:
        """The speech ended (``t_end``: when, ``time.perf_counter()`` s; ``drop_tail``:
        samples after it beyond ``pad_ms``, left out of its transcript; ``waited_ms``: silence
        the end-of-turn policy waited beyond ``end_silence_ms``, which admission does not
        charge to the server): refuse its turn or submit it."""
        turn, self.asr = self.asr, None
        held, self._held = self._held, None
        self.ids.speech_ended(end)
        turn_id = self.ids.of(turn) if turn is not None else self.ids.speech_id
        await self.out.send(ev.SpeechStopped(turn_id=turn_id, audio_ms=int(end.end * 1000 / RATE), reason=end.reason))
        if turn is None:
            await self._stopped(None, end, submitted=False)
            return
        spec = self._spec
        if spec is not None and spec.resp is not None:  # a running speculation was admitted at the pause
            self.gate.admitted_earlier(turn, waited_ms=waited_ms)
        else:
            refusal = self.gate.check(spoken=True, since_end_ms=(time.perf_counter() - t_end) * 1000 - waited_ms,
                                      key=turn, prompt_chars=self._prompt_chars(turn),
                                      client_ended=end.reason == "input_end", own_asr=int(turn.urgent_in_flight),
                                      own_llm=self.queued_replies(), waited_ms=waited_ms)
            if refusal is not None:
                decode = self.gate.decodes_refused(refusal, own_asr=int(turn.urgent_in_flight))
                self._refuse(turn)
                await self._stopped(turn, end, submitted=False)
                await send_busy(self.out, refusal.as_busy(), turn_id=turn_id)
                if decode:
                    turn.end_input(drop_tail=drop_tail)
                self._keep_words(turn, decode=decode)
                return
        await self._stopped(turn, end, submitted=True)
        turn.end_input(drop_tail=drop_tail)
        self._spec = None
        self.machine.fire(StageEvent.SUBMIT)
        if held is not None:  # no partial decided: its final transcript does
            self._submit(lambda: self._finish_held(turn, held, t_end), turn)
        elif spec is not None:
            self._confirming = spec
            self._submit(lambda: self.work.confirm(spec), turn)
        else:
            self._submit(lambda: self.work.transcribe_and_reply(turn, t_end), turn)

    async def _finish_held(self, turn: AsrTurn, held: tuple[AsrTurn, int], t_end: float) -> None:
        """The work of speech turn ``turn``, held back from continuing the earlier turn
        ``held`` and ended before a partial transcript decided (a slow ASR, short words):
        its final transcript decides. Words continue the earlier turn after all — its reply
        is cancelled (``continued``) and the whole utterance is decoded again as one turn,
        reported under ``turn``'s id — a backchannel or no words leave the reply alone, as
        for any speech over it (:meth:`TurnWork.reply`)."""
        result = await self.work.decode(turn)
        if result is None:
            return
        audio = turn.stream.audio()
        if audio is None or not self.barge.continues_with(turn, result.text, result.language):
            await self.work.reply(turn, result, t_end)
            return
        await self.barge.cancel(turn, "continued")
        spec, self._confirming = self._confirming, None
        if spec is not None and spec.resp is not self.replies.current:
            spec.drop()
        await self.replies.cancel("continued")
        old = held[0]
        self._join(turn, held, audio)
        old.end_input()
        await self.work.transcribe_and_reply(old, t_end, key=turn)

    async def _stopped(self, turn: AsrTurn | None, end: SpeechEnd, *, submitted: bool) -> None:
        """Tell the turn state and the barge-in handling that the speech ended (``submitted``:
        its turn goes to its final transcript)."""
        self.turn_state.speech_stopped(turn_submitted=submitted)
        await self.barge.speech_ended(turn, speech_ms=(end.end - end.start) * 1000 / RATE, submitted=submitted)

    def _refuse(self, turn: AsrTurn) -> None:
        """Stop a refused turn before any final decode: its streaming ASR stops. Its audio
        stays: speech that resumes within the merge window continues it (the user only
        paused), and the whole turn is decided again at its new end — no words lost."""
        self.drop_speculation(reopen=False)
        turn.close()
        self.machine.fire(StageEvent.REFUSE)

    def _keep_words(self, turn: AsrTurn, *, decode: bool) -> None:
        """A refused turn keeps its words: the history records it at once as an unanswered
        user turn (the words its partials committed so far), and a task reports its
        ``transcript.final`` (``unanswered``; decoded in the background if ``decode``, see
        :meth:`TurnWork.unanswered`) and puts the final words in that entry.

        Speech that continues the turn takes both back (:meth:`_take_back`): the merged
        turn is decided again at its new end, and its own ``transcript.final`` (same turn
        id, the whole utterance) supersedes one already sent."""
        kept = _Unanswered(turn, self.history.add_unanswered(turn.committed().text))
        kept.task = self._spawn(self._report_words(kept, decode=decode))
        self._unanswered = kept

    async def _report_words(self, kept: _Unanswered, *, decode: bool) -> None:
        result = await self.work.unanswered(kept.turn, decode=decode)
        if result is None:
            self.history.forget(kept.entry)
        else:
            kept.entry = self.history.revise(kept.entry, result.text)

    def _take_back(self, turn: AsrTurn) -> None:
        """Speech continues refused turn ``turn``: its final transcript is not reported
        (or no longer stands) and its history entry goes; the merged turn has the words."""
        kept = self._unanswered
        if kept is None or kept.turn is not turn:
            return
        self._unanswered = None
        if kept.task is not None:
            kept.task.cancel()
        self.history.forget(kept.entry)

    async def restart(self, audio_ms: int) -> None:
        """``session.start`` again: speech in progress ends here, unanswered (``audio_ms``:
        where the old stream stopped); every turn is forgotten."""
        self.drop_speculation(reopen=False)
        self.barge.reset()
        kept, self._unanswered = self._unanswered, None
        if kept is not None and kept.task is not None:
            kept.task.cancel()  # no transcript of a forgotten turn after session.started (its history entry stays)
        if self.asr is not None:
            turn_id = self.ids.of(self.asr)
            await self.out.send(ev.SpeechStopped(turn_id=turn_id, audio_ms=audio_ms, reason="restart"))
            self.turn_state.speech_stopped(turn_submitted=False)
            await self.out.send(ev.TurnEmpty(turn_id=turn_id, reason="restart"))
        for turn in (self.asr, self.last):
            if turn is not None:
                turn.close()
        self.asr = self.last = None
        self.ids.reset()
        self.machine.fire(StageEvent.RESET)

    # ---- admission (see pipeline/session/gate.py) --------------------------------------

    def over_reply(self) -> bool:
        """The speech in progress began over a reply (being sent, or all sent and still played
        by the client) and no partial transcript has decided it yet: it stays a barge-in
        candidate after that reply's audio is all sent (``response.done``), which ends
        :attr:`TurnState.interrupting`."""
        return self.asr is not None and self.barge.spoken_over(self.asr)

    def queued_replies(self) -> int:
        """This session's replies (the current one, a speculation's) whose LLM request
        still waits in the LLM's queue: a new turn's reply replaces them."""
        spec, confirming = self._spec, self._confirming
        return self.replies.queued(spec.resp if spec else None, confirming.resp if confirming else None)

    def _prompt_chars(self, turn: AsrTurn) -> int:
        """The prompt's size past the system prompt, in characters, before any final
        transcript: the history and the turn's speech at :data:`CHARS_PER_SPEECH_S`."""
        return self.history.chars + int(turn.stream.total_s * CHARS_PER_SPEECH_S)

    # ---- the turn's task (its work: pipeline/session/turn_work.py) ---------------------

    def _submit(self, work: Callable[[], Coroutine[Any, Any, None]], turn: AsrTurn) -> None:
        """Start a submitted turn's task: its transcription and reply start (``work()``, created
        inside the task, so that a task cancelled before it starts leaves no coroutine behind).
        :meth:`_answered` runs when the task ends, however it ends."""
        task = self._spawn(self._answer(work))
        task.add_done_callback(lambda done: self._answered(done, turn))
        self._task = task

    @staticmethod
    async def _answer(work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        await work()

    def _answered(self, task: asyncio.Task, turn: AsrTurn) -> None:
        """A turn's task ended — done, failed, or cancelled, even before it ran (speech that
        continued the turn at once: a ``finally`` in the task would never run then, and the
        turn state would wait for a transcript forever). A turn whose reply is not running
        no longer counts as pending for admission — also when an earlier turn's reply still
        plays (a backchannel spoken over it: counted, such turns filled the queue limit and
        the session's next turns were refused as busy); if it is still the latest ended
        turn's task, the turn state's transcript is done (whatever happened)."""
        current = self.replies.current
        if current is None or not current.running or current.turn_id != self.ids.of(turn):
            self.gate.release(turn)
        if task is self._task:
            self.turn_state.transcript_done()
            self.machine.fire(StageEvent.TASK_DONE)

    # ---- speculative end of turn (see pipeline/session/speculation.py) -----------------

    def paused(self, *, drop_tail: int, t_end: float) -> None:
        """The speech paused (``t_end``: when it stopped, ``time.perf_counter()`` s;
        ``drop_tail``: samples since, beyond ``pad_ms``): decode the final transcript and
        start the reply now, held back until the turn really ends. Only when nothing else
        is in progress (no reply, nor one all sent and still playing: speech over it may be
        a backchannel) and admission would take the turn now."""
        turn = self.asr
        if turn is None or self._held is not None or self.barge.spoken_over(turn) \
                or not self.machine.may_speculate(busy=self.turn_state.busy):
            return
        since_end_ms = (time.perf_counter() - t_end) * 1000 + self.cfg.end_silence_ms - self.cfg.early_end_ms
        if self.gate.check(spoken=True, since_end_ms=since_end_ms, key=turn, count=False,
                           prompt_chars=self._prompt_chars(turn), own_asr=int(turn.urgent_in_flight),
                           own_llm=self.queued_replies()) is not None:
            return  # the turn's end will be refused: spend nothing on it now
        # admitted uncounted: the speculation holds its place (pending, critical) while it runs
        spec = Speculation(turn=turn, outbox=HeldOutbox(self.out), t_end=t_end)
        # decode what the final would: the speech and pad_ms after it, not the pause
        spec.task = self._spawn(self.work.speculate(spec, drop_tail))
        self._spec = spec
        self.machine.fire(StageEvent.SPECULATE)

    def drop_speculation(self, *, reopen: bool = True) -> None:
        """The user went on speaking (or typed a turn, or the session changed): discard the
        speculation, if one runs (``reopen``: its turn's streaming ASR goes on)."""
        spec, self._spec = self._spec, None
        if spec is not None:
            self.machine.fire(StageEvent.DROP)
            metrics.SPECULATIONS.labels("dropped").inc()
            spec.drop()
            self.gate.release(spec.turn)  # its place in admission's count goes back
            if reopen and spec.turn is self.asr:
                spec.turn.reopen()
