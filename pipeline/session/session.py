"""One conversation: audio in → VAD turns → ASR → LLM → TTS → audio out.

A :class:`Session` is transport-agnostic: the server feeds it parsed events and audio
bytes and gives it an :class:`Outbox` to talk back through. Every model call goes to
a shared engine (off the event loop); every failure is reported to this session's
client as an ``error`` event and never reaches another session.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from audio.pcm import RATE, AudioFormatError, PcmDecoder, PcmFormat
from pipeline import metrics
from pipeline.asr.turn import AsrTurn
from pipeline.asr.types import Partial
from pipeline.config import VoxpipeConfig
from pipeline.engines import Engines
from pipeline.errors import Busy
from pipeline.serving.admission import Admission
from pipeline.serving.governor import Governor
from pipeline.session import events as ev
from pipeline.session.endpointing import AllSpeech
from pipeline.session.gate import CHARS_PER_SPEECH_S, TurnGate
from pipeline.session.history import ChatHistory
from pipeline.session.quiet_batch import QUIET_BATCH_MS, QuietBatcher
from pipeline.session.replies import CANCEL_WAIT_S, Replies, send_busy
from pipeline.session.speculation import HeldOutbox, Speculation
from pipeline.session.status import StatusFeed
from pipeline.session.turn_state import TurnState
from pipeline.session.turn_tracker import INLINE_VAD_SAMPLES, TurnTracker
from pipeline.session.types import Outbox, SpeechEnd, SpeechPause, SpeechResume, SpeechStart

logger = logging.getLogger(__name__)


MERGE_DETECT_SLACK_S = 1.0
"""Clock slack of the merge window: speech is detected a little after it starts (the VAD's
minimum speech), so resumed speech is seen up to about this much later than it began."""


class Session:
    """Per-connection turn logic: the async orchestration around a :class:`TurnTracker`
    (audio → turn events), :class:`AsrTurn` s (streaming transcripts), speculations and
    :class:`Replies`, with a :class:`TurnState` deciding barge-in and speculation.

    Args:
        engines: the shared model stages (anything implementing :mod:`pipeline.stages`).
        cfg: configuration.
        out: the client's outbox.
        session_id: id used in logs.
        admission: the server's admission policy (None: every turn is admitted).
        governor: the server's service level: degradations, ``server.status`` (None: none).
    """

    def __init__(self, *, engines: Engines, cfg: VoxpipeConfig, out: Outbox, session_id: str,
                 admission: Admission | None = None, governor: Governor | None = None) -> None:
        self.engines, self.cfg, self.out, self.id = engines, cfg, out, session_id
        self.gate = TurnGate(admission, engines, cfg, session_id, governor)
        self.status = StatusFeed(governor, out, self._spawn)
        self.started = False
        self.fmt: PcmFormat | None = None
        self.output_rate = 24000
        self.language: str | None = None
        self.history = ChatHistory(cfg.llm.system_prompt, examples=cfg.llm.examples)
        self._decoder: PcmDecoder | None = None
        self._quiet = QuietBatcher(1)  # replaced by session.start
        self._tracker = TurnTracker(cfg.turn, AllSpeech())  # replaced by session.start
        self._turn_task: asyncio.Task | None = None  # final ASR of the latest turn, then its reply
        self._last_turn: tuple[int, int] | None = None  # (start, end) samples of the latest turn
        self._last_end_t = -math.inf  # when the latest turn's speech ended (perf_counter s)
        self._last_refused = False  # the latest turn was refused (busy): continuing it re-decides it
        self._asr: AsrTurn | None = None  # streaming ASR of the speech in progress
        self._last_asr: AsrTurn | None = None  # ... of the latest turn (speech may continue it)
        self._tasks: set[asyncio.Task] = set()
        self.turn_state = TurnState()
        self.replies = Replies(engines=engines, cfg=cfg, out=out, history=self.history,
                               turn_state=self.turn_state, spawn=self._spawn, session_id=session_id,
                               times=self.gate.times, governor=governor)
        self._turn_closed = False  # the client ended the latest turn with input.end
        self._speech_start = 0  # sample where the speech in progress started
        self._spec: Speculation | None = None  # speculative end of the turn in progress
        self._confirming: Speculation | None = None  # ... handed to the latest turn's task at its end
        # turn ids (events.TurnId): per session, in the order turns begin
        self._turn_seq = 0  # the latest id given out
        self._speech_turn_id = 0  # id of the latest speech turn (its partials carry it)
        self._turn_ids: weakref.WeakKeyDictionary[AsrTurn, int] = weakref.WeakKeyDictionary()  # speech turns' ids

    # ---- client events -------------------------------------------------------------

    async def start(self, req: ev.SessionStart) -> None:
        """Handle ``session.start``: (re)declare formats and reset the audio state.
        With ``req.vad`` False every sample is speech: turns end at ``input.end``."""
        sample_rate, channels, output_sample_rate = req.sample_rate, req.channels, req.output_sample_rate
        system_prompt, language, vad = req.system_prompt, req.language, req.vad
        self.fmt = PcmFormat(sample_rate, req.format, channels)
        await self.replies.cancel("restart")  # its audio is in the old output format
        self._decoder = PcmDecoder(self.fmt)
        self._quiet = QuietBatcher(max(1, self.fmt.frame_bytes * sample_rate * QUIET_BATCH_MS // 1000))
        old_pos = self._tracker.pos
        self._tracker = TurnTracker(self.cfg.turn, self.engines.vad.stream() if vad else AllSpeech())
        self._drop_speculation(reopen=False)
        if self._asr is not None:  # speech in progress: its turn ends here, unanswered
            turn_id = self._turn_id(self._asr)
            await self.out.send(ev.SpeechStopped(turn_id=turn_id, audio_ms=int(old_pos * 1000 / RATE),
                                                 reason="restart"))
            self.turn_state.speech_stopped(turn_submitted=False)
            await self.out.send(ev.TurnEmpty(turn_id=turn_id, reason="restart"))
        for turn in (self._asr, self._last_asr):
            if turn is not None:
                turn.close()
        self._last_turn = self._asr = self._last_asr = None
        self.output_rate = self.replies.output_rate = output_sample_rate
        self.language = await self._asr_language(language)
        if system_prompt:
            self.history.system_prompt = system_prompt
        self.started = True
        await self.out.send(ev.SessionStarted(
            session_id=self.id,
            input=ev.AudioFormat(sample_rate=sample_rate, format=req.format, channels=channels),
            output=ev.AudioFormat(sample_rate=output_sample_rate, format="pcm16", channels=1)))
        await self.status.started()

    def audio_bytes_per_s(self) -> int | None:
        """Bytes per second of audio in the declared wire format; None before
        ``session.start``."""
        fmt = self.fmt if self._decoder is not None else None
        return None if fmt is None else fmt.frame_bytes * fmt.sample_rate

    async def on_audio(self, data: bytes) -> None:
        """Handle a binary audio frame in the declared format (any length). While no speech
        is in progress, frames are handled in batches of 80 ms (:mod:`~pipeline.session.quiet_batch`)."""
        decoder = self._decoder
        if not self.started or decoder is None:
            await self.error("no_session", "send session.start before audio")
            return
        if decoder.error is not None:
            return  # reported once; the stream is dropped until a new session.start
        ep = self._tracker.endpointer
        data = self._quiet.take(data, quiet=self._asr is None and not ep.in_speech and ep.pending_start is None)
        if data:
            await self._decode(decoder, data)

    async def _decode(self, decoder: PcmDecoder, data: bytes) -> None:
        try:
            samples = decoder.feed(data)
        except AudioFormatError as exc:
            await self.error("bad_audio", f"{exc}; audio is ignored until a new session.start")
            return
        await self._consume(samples)

    async def end_input(self) -> None:
        """Handle ``input.end``: the user's turn is over now."""
        decoder = self._decoder
        if not self.started or decoder is None:
            await self.error("no_session", "send session.start first")
            return
        held = self._quiet.drain()
        if held and decoder.error is None:
            await self._decode(decoder, held)
        await self._consume(decoder.flush())
        end = self._tracker.finish()
        if end is not None:
            await self._end_of_speech(end, t_end=time.perf_counter())
        self._turn_closed = True  # later speech starts a new turn
        if end is None and not self.turn_state.busy:  # a turn of its own, with no speech
            await self.out.send(ev.TurnEmpty(turn_id=self._new_turn_id(), reason="no_speech"))

    async def text_input(self, text: str) -> None:
        """Handle ``text.input``: a typed user turn (refused with ``busy`` when admission
        predicts its reply would miss the SLO; the current reply then goes on). Blank text
        is refused with ``error`` ``bad_event`` and starts no turn."""
        if not text.strip():
            await self.error("bad_event", "invalid text.input: text is blank (only whitespace)")
            return
        turn_id = self._new_turn_id()
        key = object()
        refusal = self.gate.check(spoken=False, since_end_ms=0.0, key=key, prompt_chars=self.history.chars + len(text),
                                  own_llm=self._queued_replies())
        if refusal is not None:
            await send_busy(self.out, refusal.as_busy(), turn_id=turn_id)
            return
        self._drop_speculation()
        await self.replies.begin(text, turn_id=turn_id, t_end=time.perf_counter(), asr_ms=0.0,
                                 hooks=self.gate.hooks(key))

    async def cancel_response(self) -> None:
        """Handle ``response.cancel``: stop the current reply, if any."""
        await self.replies.cancel("client")

    async def close(self) -> None:
        """Tear down: stop the reply (its LLM request is aborted) and every task."""
        self.status.close()
        self.replies.stop()
        self.engines.end_session(self.id)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:  # never let a stuck task keep a closed session alive
            _, stuck = await asyncio.wait(set(self._tasks), timeout=CANCEL_WAIT_S)
            if stuck:
                logger.warning("session %s: %d task(s) did not stop on close", self.id, len(stuck))

    async def error(self, code: ev.ErrorCode, message: str, *, fatal: bool = False) -> None:
        """Send an ``error`` event (and count it)."""
        metrics.ERRORS.labels(code).inc()
        await self.out.send(ev.Error(code=code, message=message, fatal=fatal))

    # ---- audio → turns -------------------------------------------------------------

    async def _asr_language(self, language: str | None) -> str | None:
        """The language to decode: None (detect) when not given; a code the model does
        not know is reported and detected instead. English-only models ignore it."""
        asr = self.engines.asr
        if language is not None and not getattr(asr, "multilingual", False) and language != "en":
            await self.error("bad_event", f"the ASR model is English-only: language {language!r} is not "
                                          "supported (start the server with --asr-model base); decoding English")
            return "en"
        if language is None or not getattr(asr, "multilingual", False):
            return language
        if language not in asr.languages:
            await self.error("bad_event", f"unknown language {language!r}; detecting the language instead")
            return None
        return language

    async def _consume(self, samples: np.ndarray) -> None:
        """16 kHz samples → the tracker (and the streaming ASR of the speech in progress);
        act on the turn events they cause."""
        if len(samples) == 0:
            return
        tracker = self._tracker
        tracker.append(samples)
        if self._asr is not None:
            self._asr.feed(samples)  # streaming ASR of the speech in progress
        if len(samples) <= INLINE_VAD_SAMPLES:  # a few windows: cheaper than a thread hop
            probs = tracker.detect(samples)
        else:
            probs = await asyncio.to_thread(tracker.detect, samples)
        for turn_ev in tracker.endpoint(probs):
            if isinstance(turn_ev, SpeechStart):
                turn_id = self._speech_turn_id = self._turn_id_at(turn_ev.sample)
                await self.out.send(ev.SpeechStarted(turn_id=turn_id, audio_ms=int(turn_ev.sample * 1000 / RATE)))
                await self._start_turn(turn_ev.sample)
                if self._asr is not None:
                    self._turn_ids[self._asr] = turn_id
            elif isinstance(turn_ev, SpeechPause):
                self._speculate(turn_ev.end, t_end=time.perf_counter() - (tracker.pos - turn_ev.end) / RATE)
            elif isinstance(turn_ev, SpeechResume):
                self._drop_speculation()
            elif isinstance(turn_ev, SpeechEnd):
                silence_s = (tracker.pos - turn_ev.end) / RATE if turn_ev.reason == "silence" else 0.0
                await self._end_of_speech(turn_ev, t_end=time.perf_counter() - silence_s)

    def _continues_last_turn(self, start: int) -> bool:
        """Speech starting at ``start`` continues the latest turn: it resumed within
        ``merge_window_ms`` of its end — in the audio and on the clock (a client that
        stopped sending while it waited for the reply resumes close in audio, long after
        in time: a new turn) — the client did not close it, and the merged turn would stay
        well under ``max_turn_s``."""
        last, t = self._last_turn, self.cfg.turn
        window_s = t.merge_window_ms / 1000
        return (last is not None and self._last_asr is not None and not self._turn_closed
                and start - last[1] <= window_s * RATE
                and time.perf_counter() - self._last_end_t <= window_s + MERGE_DETECT_SLACK_S
                and (start - last[0]) / RATE < t.max_turn_s * 0.8)

    def _new_turn_id(self) -> int:
        self._turn_seq += 1
        return self._turn_seq

    def _turn_id_at(self, start: int) -> int:
        """The id of the turn that speech starting at ``start`` belongs to: the latest
        turn's if it continues it (see :meth:`_start_turn`), else a new one."""
        last = self._last_asr
        if last is not None and last in self._turn_ids and self._continues_last_turn(start):
            return self._turn_ids[last]
        return self._new_turn_id()

    def _turn_id(self, turn: AsrTurn) -> int:
        """The id of speech turn ``turn``."""
        return self._turn_ids.get(turn, self._speech_turn_id)

    async def _start_turn(self, start: int) -> None:
        """Speech started: stream it to the ASR. Speech that resumes soon after the last
        turn ended continues that turn (its reply is cancelled; its words stay)."""
        self._speech_start = start
        self.turn_state.speech_started()  # over a reply: a barge-in candidate until ASR confirms words
        turn = self._last_asr
        if turn is not None and self._continues_last_turn(start):
            if self._last_refused:  # a refused turn goes on: no reply of it to cancel
                self._last_refused = False
            else:
                if self._turn_task is not None:
                    self._turn_task.cancel()
                spec, self._confirming = self._confirming, None
                if spec is not None and (spec.resp is None or spec.resp is not self.replies.current):
                    # its confirmation may be cancelled before it ran: nothing else stops it
                    # (nor its decode, whose reply would otherwise start unseen, an orphan)
                    spec.drop()
                await self.replies.cancel("continued")
            turn.reopen()
        else:
            self._last_refused = False
            self._last_turn = (start, start)
            turn = AsrTurn(self.engines.asr, self.cfg.asr, language=self.language,
                           on_partial=self._on_partial, spawn=self._spawn, hold=self._hold_partials)
        self._asr = self._last_asr = turn
        turn.feed(self._tracker.since(start))

    def _hold_partials(self) -> float:
        """How long this session's partial transcripts may wait now (ms; see
        :meth:`TurnGate.hold_ms`) — not at all while this speech is over a reply (a
        barge-in candidate: only a partial with words can confirm it)."""
        return 0.0 if self.turn_state.interrupting else self.gate.hold_ms()

    async def _on_partial(self, part: Partial) -> None:
        # only the latest speech turn's ASR is open (sends partials)
        await self.out.send(ev.TranscriptPartial(turn_id=self._speech_turn_id, committed=part.committed,
                                                 unstable=part.unstable, text=part.text, language=part.language))
        await self._maybe_barge_in()

    async def _maybe_barge_in(self) -> None:
        """The user talks over the reply: speech that lasted ``barge_in_min_ms`` and that
        the ASR heard words in (a partial transcript) cancels it. Coughs, claps and noise
        give no words (or too short a burst) and leave the reply alone."""
        ts = self.turn_state
        long_enough = (self._tracker.pos - self._speech_start) * 1000 / RATE >= self.cfg.turn.barge_in_min_ms
        if ts.interrupting and long_enough:
            ts.barge_in()
            await self.replies.cancel("barge_in")

    async def _end_of_speech(self, end: SpeechEnd, *, t_end: float) -> None:
        turn, self._asr = self._asr, None
        start = self._last_turn[0] if self._last_turn else end.start
        self._last_turn, self._last_end_t = (start, end.end), t_end
        # a turn the client ended (input.end, push-to-talk) is never continued by later speech
        self._turn_closed = end.reason == "input_end"
        turn_id = self._turn_id(turn) if turn is not None else self._speech_turn_id
        await self.out.send(ev.SpeechStopped(turn_id=turn_id, audio_ms=int(end.end * 1000 / RATE), reason=end.reason))
        spec = self._spec
        speculated = spec is not None and spec.turn is turn and spec.resp is not None
        refusal = None
        if turn is not None and not speculated:  # a running speculation was admitted at the pause
            refusal = self.gate.check(spoken=True, since_end_ms=(time.perf_counter() - t_end) * 1000, key=turn,
                                      prompt_chars=self._prompt_chars(turn), client_ended=end.reason == "input_end",
                                      own_asr=int(turn.urgent_in_flight), own_llm=self._queued_replies())
        elif turn is not None:
            self.gate.admitted_earlier()
        if turn is not None and refusal is not None:
            self._refuse_turn(turn)
            self.turn_state.speech_stopped(turn_submitted=False)
            await send_busy(self.out, refusal.as_busy(), turn_id=turn_id)
            return
        self.turn_state.speech_stopped(turn_submitted=turn is not None)
        if turn is None:
            return
        turn.end_input(drop_tail=self._tracker.tail_after(end.end))
        spec, self._spec = self._spec, None
        if spec is not None and spec.turn is turn:
            self._confirming = spec
            self._turn_task = self._spawn(self._answer_turn(lambda: self._confirm(spec), turn))
        else:
            self._turn_task = self._spawn(self._answer_turn(lambda: self._transcribe_and_reply(turn, t_end), turn))

    # ---- admission (see pipeline/session/gate.py) ------------------------------------

    def _queued_replies(self) -> int:
        """This session's replies (the current one, a speculation's) whose LLM request
        still waits in the LLM's queue: a new turn's reply replaces them."""
        spec, confirming = self._spec, self._confirming
        return self.replies.queued(spec.resp if spec else None, confirming.resp if confirming else None)

    def _prompt_chars(self, turn: AsrTurn) -> int:
        """The prompt's size past the system prompt, in characters, before any final
        transcript: the history and the turn's speech at :data:`CHARS_PER_SPEECH_S`."""
        return self.history.chars + int(turn.stream.total_s * CHARS_PER_SPEECH_S)

    def _refuse_turn(self, turn: AsrTurn) -> None:
        """Stop a refused turn before any final decode: its streaming ASR stops. Its audio
        stays: speech that resumes within the merge window continues it (the user only
        paused), and the whole turn is decided again at its new end — no words lost."""
        self._drop_speculation(reopen=False)
        turn.close()
        self._last_refused = self._last_asr is turn

    async def _answer_turn(self, work: Callable[[], Coroutine[Any, Any, None]], turn: AsrTurn) -> None:
        """Run a submitted turn's transcription and reply start (``work()``, created here
        so that a task cancelled before it starts leaves no coroutine behind); then, if it
        is still the latest turn's, tell the turn state its transcript is done (whatever
        happened). A turn that started no reply no longer counts as pending for admission."""
        try:
            await work()
        finally:
            if self.replies.current is None or not self.replies.current.running:
                self.gate.release(turn)
            if asyncio.current_task() is self._turn_task:
                self.turn_state.transcript_done()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _transcribe_and_reply(self, turn: AsrTurn, t_end: float) -> None:
        try:
            result = await turn.finish()
        except Busy as exc:
            await send_busy(self.out, exc, turn_id=self._turn_id(turn))
            return
        except Exception as exc:
            logger.exception("session %s: ASR failed", self.id)
            await self.error("asr_failed", f"transcription failed: {exc}")
            return
        if await self._final_transcript(turn, result):
            await self.replies.begin(result.text, turn_id=self._turn_id(turn), t_end=t_end, asr_ms=turn.last_decode_ms,
                                     hooks=self.gate.hooks(turn))

    async def _final_transcript(self, turn: AsrTurn, result: Partial) -> bool:
        """Report the turn's final transcript; False (and ``turn.empty``) if it has no words."""
        audio_s = turn.stream.total_s
        metrics.ASR_SECONDS.observe(turn.decode_ms / 1000)
        if audio_s > 0:
            metrics.ASR_RTF.observe(turn.decode_ms / 1000 / audio_s)
        if not result.text:
            self.turn_state.turn_empty()
            await self.out.send(ev.TurnEmpty(turn_id=self._turn_id(turn), reason="no_words"))
            return False
        await self.out.send(ev.TranscriptFinal(turn_id=self._turn_id(turn), text=result.text, language=result.language,
                                               audio_ms=int(audio_s * 1000)))
        return True

    # ---- speculative end of turn (see pipeline/speculation.py) ----------------------

    def _speculate(self, speech_end: int, *, t_end: float) -> None:
        """The speech paused: decode the final transcript and start the reply now,
        held back until the turn really ends. Only when nothing else is in progress."""
        turn = self._asr
        if turn is None or self._spec is not None or not self.turn_state.may_speculate:
            return
        since_end_ms = (time.perf_counter() - t_end) * 1000 + self.cfg.turn.end_silence_ms - self.cfg.turn.early_end_ms
        if self.gate.check(spoken=True, since_end_ms=since_end_ms, key=turn, count=False,
                           prompt_chars=self._prompt_chars(turn), own_asr=int(turn.urgent_in_flight),
                           own_llm=self._queued_replies()) is not None:
            return  # the turn's end will be refused: spend nothing on it now
        # admitted uncounted: the speculation holds its place (pending, critical) while it runs
        spec = Speculation(turn=turn, outbox=HeldOutbox(self.out), t_end=t_end)
        # decode what the final would: the speech and pad_ms after it, not the pause
        spec.task = self._spawn(self._run_speculation(spec, self._tracker.tail_after(speech_end)))
        self._spec = spec

    async def _run_speculation(self, spec: Speculation, drop_tail: int) -> None:
        try:
            spec.peek = await spec.turn.peek_final(drop_tail=drop_tail)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.debug("session %s: no speculation", self.id, exc_info=True)
            return
        text = spec.peek[0].text if spec.peek is not None else ""
        if text:
            spec.resp = self.replies.new(out=spec.outbox, release=spec.outbox.released)
            self.replies.run(spec.resp, text, turn_id=self._turn_id(spec.turn), t_end=spec.t_end,
                             asr_ms=spec.turn.last_decode_ms, hooks=self.gate.hooks(spec.turn))

    def _drop_speculation(self, *, reopen: bool = True) -> None:
        """The user went on speaking (or the session changed): discard the speculation."""
        spec, self._spec = self._spec, None
        if spec is not None:
            metrics.SPECULATIONS.labels("dropped").inc()
            spec.drop()
            self.gate.release(spec.turn)  # its place in admission's count goes back
            if reopen and spec.turn is self._asr:
                spec.turn.reopen()

    async def _confirm(self, spec: Speculation) -> None:
        """The turn ended where the speculation decoded it: make its transcript final
        and let its reply out (or fall back to a normal final decode)."""
        promoted = False
        try:
            if spec.task is not None:
                await asyncio.gather(spec.task, return_exceptions=True)
            if spec.peek is None or spec.turn.decoding:  # no peek, or the buffer moved on since
                metrics.SPECULATIONS.labels("failed").inc()
                await self._transcribe_and_reply(spec.turn, spec.t_end)
                return
            metrics.SPECULATIONS.labels("used").inc()
            _, req, result = spec.peek
            final = spec.turn.commit_final(req, result)
            if not await self._final_transcript(spec.turn, final):
                return
            if spec.resp is None:
                return
            await self.replies.promote(spec.resp)
            promoted = True
            await spec.outbox.release()
            if not spec.resp.running:  # it ended (failed) before it became current
                self.replies.settle(spec.resp)
        finally:
            if not promoted and spec.resp is not None:
                spec.resp.cancel()
