"""One conversation: audio in → VAD turns → ASR → LLM → TTS → audio out.

A :class:`Session` is transport-agnostic: the server feeds it parsed events and audio
bytes and gives it an :class:`Outbox` to talk back through. Every model call goes to
a shared engine (off the event loop); every failure is reported to this session's
client as an ``error`` event and never reaches another session.

This module is the wire side: client events, audio decoding, the turn tracker, and
barge-in. A :class:`~pipeline.session.turn_runner.TurnRunner` runs each speech turn from
its speech to its reply; :class:`~pipeline.session.turn_ids.TurnIds` numbers the turns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, cast

import numpy as np

from audio.pcm import RATE, PcmFormat
from pipeline import metrics
from pipeline.asr.turn import AsrTurn
from pipeline.asr.types import Partial
from pipeline.config import VoxpipeConfig
from pipeline.engines import Engines
from pipeline.serving.admission import Admission
from pipeline.serving.governor import Governor
from pipeline.session import events as ev
from pipeline.session.end_of_turn import EndOfTurnPolicy, eagerness
from pipeline.session.endpointing import AllSpeech
from pipeline.session.gate import TurnGate
from pipeline.session.history import ChatHistory
from pipeline.session.replies import CANCEL_WAIT_S, Replies, send_busy
from pipeline.session.status import StatusFeed
from pipeline.session.tools import SessionTools
from pipeline.session.turn_ids import TurnIds
from pipeline.session.turn_runner import TurnRunner
from pipeline.session.turn_state import TurnState
from pipeline.session.turn_tracker import INLINE_VAD_SAMPLES, TurnTracker
from pipeline.session.types import Outbox, SpeechCheck, SpeechEnd, SpeechPause, SpeechResume, SpeechStart, TurnEvent
from pipeline.session.wire_input import OpusInput, PcmInput, WireInput

logger = logging.getLogger(__name__)

ARRIVALS_KEPT = 2048
"""Input frames whose arrival is kept for the merge window's client clock (at 20 ms a frame,
40 s of audio: far beyond ``merge_window_ms``)."""


class Session:
    """Per-connection turn logic: the async orchestration around a :class:`TurnTracker`
    (audio → turn events), a :class:`TurnRunner` (each speech turn to its reply, with its
    :class:`AsrTurn`, speculation and admission) and :class:`Replies`, with a
    :class:`TurnState` deciding barge-in.

    Args:
        engines: the shared model stages (anything implementing :mod:`pipeline.stages`).
        cfg: configuration.
        out: the client's outbox.
        session_id: id used in logs.
        admission: the server's admission policy (None: every turn is admitted).
        governor: the server's service level: degradations, ``server.status`` (None: none).

    Attributes:
        client_clock: seconds that run at least while the server waits for the client's
            next frame (the server's reader sets it to exactly that: ``FrameReader.waited``);
            when frames came on it decides whether speech may continue the latest turn
            (:class:`TurnIds`). Default: the wall clock.
    """

    def __init__(self, *, engines: Engines, cfg: VoxpipeConfig, out: Outbox, session_id: str,
                 admission: Admission | None = None, governor: Governor | None = None) -> None:
        self.engines, self.cfg, self.out, self.id = engines, cfg, out, session_id
        self.gate = TurnGate(admission, engines, cfg, session_id, governor)
        self.status = StatusFeed(governor, out, self._spawn)
        self.started = False
        self.output_rate = 24000
        self.language: str | None = None
        self.history = ChatHistory(cfg.llm.system_prompt, examples=cfg.llm.examples)
        self._input: WireInput | None = None  # set by session.start
        self._tracker = TurnTracker(cfg.turn, AllSpeech())  # replaced by session.start
        self._tasks: set[asyncio.Task] = set()
        self.turn_state = TurnState()
        self.tools = SessionTools(engines.tools, cfg.tools)
        self.replies = Replies(engines=engines, cfg=cfg, out=out, history=self.history,
                               turn_state=self.turn_state, spawn=self._spawn, session_id=session_id,
                               times=self.gate.times, governor=governor, tools=self.tools)
        self.client_clock: Callable[[], float] = time.perf_counter
        # (input position after a frame, client_clock when it came)
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=ARRIVALS_KEPT)
        self.ids = TurnIds(cfg.turn, arrival=self._arrival)
        self.runner = TurnRunner(cfg=cfg.turn, out=out, history=self.history, gate=self.gate, replies=self.replies,
                                 turn_state=self.turn_state, ids=self.ids, new_asr=self._new_asr, spawn=self._spawn,
                                 error=self.error, session_id=session_id)
        self._speech_start = 0  # sample where the speech in progress started

    def _arrival(self, sample: int) -> float:
        """``client_clock`` when the input frame holding ``sample`` (16 kHz input position)
        came: the latest frame's for a sample not yet come, the oldest kept for one older."""
        arrivals = self._arrivals
        if not arrivals:
            return self.client_clock()
        t = arrivals[-1][1]
        for pos, came in reversed(arrivals):
            if pos <= sample:
                break
            t = came
        return t

    @property
    def input_pos(self) -> int:
        """Input samples (16 kHz) received since the latest ``session.start``."""
        return self._tracker.pos

    # ---- client events -------------------------------------------------------------

    async def start(self, req: ev.SessionStart) -> None:
        """Handle ``session.start``: (re)declare formats and tools, and reset the audio
        state. With ``req.vad`` False every sample is speech: turns end at ``input.end``.
        Tools that cannot be offered (:meth:`SessionTools.declare`) get a ``bad_event`` error
        and change nothing; so does an unknown ``voice`` (the error lists the server's
        voices)."""
        sample_rate, channels, output_sample_rate = req.sample_rate, req.channels, req.output_sample_rate
        system_prompt, language, vad = req.system_prompt, req.language, req.vad
        try:
            if req.voice is not None:
                self.engines.voices.get(req.voice)
            self.tools.declare(req.tools)
        except ValueError as exc:  # the session stays as it was
            await self.error("bad_event", f"session.start: {exc}")
            return
        await self.replies.cancel("restart")  # its audio is in the old output format
        self._input = OpusInput(channels) if req.format == "opus" else PcmInput(PcmFormat(sample_rate, req.format,
                                                                                          channels))
        old_pos = self._tracker.pos
        eot = self._eot_policy(req) if vad else None
        self._tracker = TurnTracker(self.cfg.turn, self.engines.vad.stream() if vad else AllSpeech(), eot)
        self._arrivals.clear()  # input positions start again
        await self.runner.restart(audio_ms=int(old_pos * 1000 / RATE))  # speech in progress ends unanswered
        self.output_rate = self.replies.output_rate = output_sample_rate
        self.language = await self._asr_language(language)
        self.replies.voice, self.replies.language = req.voice, self.language
        if system_prompt:
            self.history.system_prompt = system_prompt
        self.started = True
        await self.out.send(ev.SessionStarted(
            session_id=self.id,
            input=ev.AudioFormat(sample_rate=sample_rate, format=req.format, channels=channels),
            output=ev.AudioFormat(sample_rate=output_sample_rate, format=req.output_format, channels=1),
            end_of_turn="input_end" if not vad else "smart-turn" if eot is not None else "silence",
            eagerness=cast(ev.Eagerness, req.eagerness or self.cfg.turn.eagerness) if eot is not None else None,
            voice=req.voice))
        logger.info("session %s: audio in %s at %d Hz, out %s at %d Hz", self.id, req.format, sample_rate,
                    req.output_format, output_sample_rate)
        await self.status.started()

    def _eot_policy(self, req: ev.SessionStart) -> EndOfTurnPolicy | None:
        """The session's semantic end of turn: the server's ``end_of_turn`` and
        ``eagerness`` unless ``session.start`` chose; None (silence alone) without the model."""
        turn = self.cfg.turn
        rule = req.end_of_turn or turn.end_of_turn
        if rule != "smart-turn" or self.engines.eot is None:
            return None
        return EndOfTurnPolicy(eagerness(req.eagerness or turn.eagerness), fallback_ms=turn.end_silence_ms)

    def audio_bytes_per_s(self) -> int | None:
        """Bytes per second of audio in the declared wire format; None before
        ``session.start`` and for a packet format (Opus: :meth:`frame_seconds`)."""
        return self._input.bytes_per_s if isinstance(self._input, PcmInput) else None

    def frame_seconds(self, data: bytes) -> float | None:
        """The audio a binary frame holds (s) in the declared format; None before
        ``session.start``."""
        return None if self._input is None else self._input.seconds(data)

    async def on_audio(self, data: bytes) -> None:
        """Handle a binary audio frame in the declared format (PCM: any length; Opus: one
        packet). While no speech is in progress, frames are handled in batches of 80 ms
        (:mod:`~pipeline.session.quiet_batch`)."""
        wire = self._input
        if not self.started or wire is None:
            await self.error("no_session", "send session.start before audio")
            return
        if wire.stopped is not None:
            return  # reported once; the stream is dropped until a new session.start
        ep = self._tracker.endpointer
        samples, problem = await wire.feed(data, quiet=self.runner.asr is None and not ep.in_speech
                                           and ep.pending_start is None)
        if problem is not None:
            await self.error("bad_audio", problem)
        await self._consume(samples)

    async def end_input(self) -> None:
        """Handle ``input.end``: the user's turn is over now."""
        wire = self._input
        if not self.started or wire is None:
            await self.error("no_session", "send session.start first")
            return
        await self._consume(await wire.end())
        end = self._tracker.finish()
        if end is not None:
            await self._end_of_speech(end, t_end=time.perf_counter())
        self.ids.close()  # later speech starts a new turn
        if end is None and not self.turn_state.busy:  # a turn of its own, with no speech
            await self.out.send(ev.TurnEmpty(turn_id=self.ids.new(), reason="no_speech"))

    def choose_voice(self, name: str | None) -> None:
        """Speak the next replies with the voice called ``name`` (None: each reply's turn
        language picks; the Realtime ``session.update`` ``voice``).

        Raises:
            UnknownVoice: the server has no such voice (the message lists those it has);
                nothing changes.
        """
        if name is not None:
            self.engines.voices.get(name)
        self.replies.voice = name

    async def text_input(self, text: str) -> None:
        """Handle ``text.input``: a typed user turn (refused with ``busy`` when admission
        predicts its reply would miss the SLO; the current reply then goes on). Blank text
        is refused with ``error`` ``bad_event`` and starts no turn."""
        if not text.strip():
            await self.error("bad_event", "invalid text.input: text is blank (only whitespace)")
            return
        turn_id = self.ids.new()
        key = object()
        refusal = self.gate.check(spoken=False, since_end_ms=0.0, key=key, prompt_chars=self.history.chars + len(text),
                                  own_llm=self.runner.queued_replies())
        if refusal is not None:
            await send_busy(self.out, refusal.as_busy(), turn_id=turn_id)
            return
        self.runner.drop_speculation()
        await self.replies.begin(text, turn_id=turn_id, t_end=time.perf_counter(), asr_ms=0.0,
                                 hooks=self.gate.hooks(key), language=self.language)

    async def tool_result(self, call_id: str, output: str) -> None:
        """Handle ``tool.result``: the client's answer to a call it runs; one no call waits
        for (unknown, answered already, timed out) gets a ``bad_event`` error."""
        if not self.tools.result(call_id, output):
            await self.error("bad_event", f"tool.result: no call {call_id[:64]!r} is waiting for a result")

    async def cancel_response(self) -> None:
        """Handle ``response.cancel``: stop the current reply, if any."""
        await self.replies.cancel("client")

    async def close(self) -> None:
        """Tear down: stop the reply (its LLM request is aborted) and every task; admission
        forgets the session's turns."""
        self.status.close()
        self.replies.stop()
        self.tools.close()
        self.engines.end_session(self.id)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:  # never let a stuck task keep a closed session alive
            _, stuck = await asyncio.wait(set(self._tasks), timeout=CANCEL_WAIT_S)
            if stuck:
                logger.warning("session %s: %d task(s) did not stop on close", self.id, len(stuck))
        self.gate.close()

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
        hand the turn events they cause to the runner."""
        if len(samples) == 0:
            return
        tracker = self._tracker
        tracker.append(samples)
        self._arrivals.append((tracker.pos, self.client_clock()))
        if self.runner.asr is not None:
            self.runner.asr.feed(samples)  # streaming ASR of the speech in progress
        if len(samples) <= INLINE_VAD_SAMPLES:  # a few windows: cheaper than a thread hop
            probs = tracker.detect(samples)
        else:
            probs = await asyncio.to_thread(tracker.detect, samples)
        pending: deque[TurnEvent] = deque(tracker.endpoint(probs))
        while pending:
            turn_ev = pending.popleft()
            if isinstance(turn_ev, SpeechStart):
                self._speech_start = turn_ev.sample
                await self.runner.speech_started(turn_ev.sample, tracker.since(turn_ev.sample))
            elif isinstance(turn_ev, SpeechPause):
                self.runner.paused(drop_tail=tracker.tail_after(turn_ev.end),
                                   t_end=time.perf_counter() - (tracker.pos - turn_ev.end) / RATE)
            elif isinstance(turn_ev, SpeechCheck):  # the endpointer waits for the answer
                pending.extend(tracker.endpointer.verdict(await self._judge(turn_ev)))
            elif isinstance(turn_ev, SpeechResume):
                self.runner.drop_speculation()
            elif isinstance(turn_ev, SpeechEnd):
                metrics.END_OF_TURN.labels(turn_ev.cause).inc()
                silence_s = (tracker.pos - turn_ev.end) / RATE if turn_ev.reason in ("silence", "end_of_turn") else 0.0
                # silence an end-of-turn policy chose to wait past the silence rule's (a "not
                # yet" up to its cap) is the user's pause, not the server's lateness
                waited_ms = max(0.0, silence_s * 1000 - self.cfg.turn.end_silence_ms)
                await self._end_of_speech(turn_ev, t_end=time.perf_counter() - silence_s, waited_ms=waited_ms)

    async def _judge(self, check: SpeechCheck) -> float | None:
        """Ask the end-of-turn model whether the speech in progress is a complete turn: the
        probability, or None when it gives no answer (busy, failed, or not within
        ``eot_timeout_ms``: the policy falls back to the silence rule)."""
        eot = self.engines.eot
        if eot is None:
            return None
        try:
            prob = await asyncio.wait_for(eot.run(self._tracker.eot_audio(check.start, check.at)),
                                          self.cfg.turn.eot_timeout_ms / 1000)
        except Exception as exc:  # noqa: BLE001 - Busy, a timeout or a model failure: the silence decides
            logger.debug("session %s: end-of-turn model gave no answer: %s", self.id, exc)
            metrics.EOT_CHECKS.labels("none").inc()
            return None
        policy = self._tracker.endpointer.policy
        complete = policy is not None and prob >= policy.setting.complete
        metrics.EOT_CHECKS.labels("complete" if complete else "wait").inc()
        return prob

    async def _end_of_speech(self, end: SpeechEnd, *, t_end: float, waited_ms: float = 0.0) -> None:
        await self.runner.speech_ended(end, t_end=t_end, drop_tail=self._tracker.tail_after(end.end),
                                       waited_ms=waited_ms)

    def _new_asr(self) -> AsrTurn:
        """Streaming ASR for a new speech turn."""
        return AsrTurn(self.engines.asr, self.cfg.asr, language=self.language, on_partial=self._on_partial,
                       spawn=self._spawn, hold=self._hold_partials)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- partial transcripts and barge-in ------------------------------------------

    def _hold_partials(self) -> float:
        """How long this session's partial transcripts may wait now (ms; see
        :meth:`TurnGate.hold_ms`) — not at all while this speech is over a reply (a
        barge-in candidate: only a partial with words can confirm it)."""
        return 0.0 if self.turn_state.interrupting or self.runner.over_reply() else self.gate.hold_ms()

    async def _on_partial(self, part: Partial) -> None:
        # only the latest speech turn's ASR is open (sends partials)
        await self.out.send(ev.TranscriptPartial(turn_id=self.ids.speech_id, committed=part.committed,
                                                 unstable=part.unstable, text=part.text, language=part.language))
        await self._maybe_barge_in(part)

    async def _maybe_barge_in(self, part: Partial) -> None:
        """The user talks over the reply: speech that lasted ``barge_in_min_ms`` and that
        the ASR heard words in (a partial transcript) cancels it. Coughs, claps and noise
        give no words (or too short a burst) and leave the reply alone; so does a
        backchannel ("yeah", "mm-hm"; :mod:`pipeline.session.barge_in`)."""
        if self.turn_state.interrupting or self.runner.over_reply():
            speech_ms = (self._tracker.pos - self._speech_start) * 1000 / RATE
            # its voiced part: a partial comes late (ASR every ~second), and the silence after
            # a "yeah" must not make it too long to be a backchannel
            voiced = self._tracker.endpointer.last_speech_end - self._speech_start
            voiced_ms = min(speech_ms, max(0.0, voiced * 1000 / RATE))
            await self.runner.words_over_reply(part.text, part.language, speech_ms, voiced_ms=voiced_ms)
