"""One assistant reply: LLM deltas → phrases → TTS → paced audio frames.

A :class:`Responder` owns one response's tasks. Cancelling its task aborts the LLM
request (the engine frees the batch slot at the next step), drops queued phrases and
stops sending audio; :attr:`Responder.spoken` then holds only the phrases whose audio
was sent for playback, which is what the conversation history keeps.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

from audio.pcm import float_to_pcm16, resample
from pipeline import metrics
from pipeline.config import VoxpipeConfig
from pipeline.engines import Engines
from pipeline.errors import Busy
from pipeline.llm.stream import stock_stream
from pipeline.llm.types import PRIORITY_VOICE, FinishReason, GenRequest
from pipeline.serving.admission import ServiceTimes
from pipeline.serving.governor import Governor
from pipeline.serving.types import TurnPolicy
from pipeline.session import events as ev
from pipeline.session.history import ChatHistory
from pipeline.session.language import with_instruction
from pipeline.session.tool_turn import ToolTurn
from pipeline.session.tools import SessionTools
from pipeline.session.types import Outbox, TurnHooks
from pipeline.stages import LlmStage, TextStream
from pipeline.tools.render import demo_exchange
from pipeline.tts.chunker import SentenceChunker, speakable
from pipeline.tts.types import Phrase, VoiceInfo

logger = logging.getLogger(__name__)

AUDIO_CHUNK_S = 0.2
"""Reply audio is sent in binary frames of about this many seconds."""
EMPTY_REPLY = "Sorry, I don't have an answer to that."
"""Spoken when the LLM returns nothing speakable (an EOS first: tests/test_speaking.py)."""


class Responder:
    """Produce and speak reply ``rid`` to ``user_text``.

    Args:
        rid: response id (goes into every event and audio frame).
        engines: shared LLM and TTS stages.
        cfg: configuration (``cfg.llm`` limits, ``cfg.tts.playback_lead_s`` pacing).
        out: the session's outbox.
        history: the session's chat history (read for the prompt, appended at the end).
        output_rate: reply audio rate (Hz).
        error: coroutine ``error(code, message)`` reporting to the client.
        on_audio_start: called once, when the first audio frame is sent.
        release: for a speculative reply (started before the turn surely ended): audio
            waits until this event is set, and a reply cancelled before that leaves the
            history alone. None: speak at once.
        governor: the server's service level: how the reply is made (:meth:`Governor.turn_policy`:
            token limits, the fallback model, a stock line) and where its voice-to-voice time
            goes (SLO adaptation). None: normal service.
        session_id: the session's id, on its LLM requests (its cached KV is released when it ends).
        tools: the tools the model may call (:mod:`pipeline.session.tool_turn`); None or none
            offered: a plain reply.
    """

    def __init__(self, *, rid: int, engines: Engines, cfg: VoxpipeConfig, out: Outbox, history: ChatHistory,
                 output_rate: int, error: Callable[[ev.ErrorCode, str], Awaitable[None]],
                 on_audio_start: Callable[[], object] | None = None,
                 release: asyncio.Event | None = None, times: ServiceTimes | None = None,
                 governor: Governor | None = None, session_id: str | None = None,
                 tools: SessionTools | None = None) -> None:
        self.rid, self.engines, self.cfg, self.out = rid, engines, cfg, out
        self.tools = tools
        self.tool_turn: ToolTurn | None = None  # set while a reply with tools runs
        self.session_id = session_id
        self.governor = governor
        self.text_only = False  # TTS refused (its breaker) or failed a phrase: the reply lacks that audio
        self.on_fallback = False  # the fallback LLM made this reply
        self._tts_failed = False  # a tts_failed error was sent (once per reply)
        self.history, self.output_rate, self.error = history, output_rate, error
        self.on_audio_start, self.release, self.times = on_audio_start, release, times
        self.started = False  # response.started was sent: the reply must end with done or cancelled
        self.hooks = TurnHooks()  # admission's callbacks for this reply's turn
        self.spoken: list[str] = []
        self.voice: VoiceInfo | None = None  # who speaks it (set before it runs; None: the stage's default)
        self._spans: list[tuple[str, float, float]] = []  # each spoken phrase: where in the reply's audio (s)
        self.timings: dict[str, float] = {}
        self.audio_s = 0.0
        self._phrases: asyncio.Queue[str | None] = asyncio.Queue()
        self._t_play: float | None = None
        self._t_first_token: float | None = None
        self._t_first_phrase: float | None = None
        self._t_release = 0.0  # when a speculative reply was confirmed (perf_counter s)
        self._stream: TextStream | None = None  # the LLM request, once submitted
        self._aborted = False  # ... and aborted
        self._playing = asyncio.Event()  # cleared while paused (a possible barge-in): no audio is sent
        self._playing.set()
        self._t_paused: float | None = None  # when it was paused (perf_counter s)
        self._ahead_at_pause = 0.0  # audio the client still had buffered then (s)

    def abort_request(self) -> None:
        """Abort the LLM request now, if it was submitted (idempotent), rather than when the
        cancelled task next runs: until the engine drops it, it counts as queued work for
        admission, which a turn that goes on at once (audio sent faster than real time)
        would see as another user's."""
        if self._stream is not None:
            self._aborted = True
            self._stream.abort()

    def played_by(self) -> float | None:
        """When the client will have played all the audio sent so far, if it plays it in real
        time from the first chunk (``time.perf_counter()`` s; the pacing clock of
        :meth:`_pace`, shifted by pauses); None before any audio."""
        return None if self._t_play is None else self._t_play + self.audio_s

    def playing_between(self, t0: float, t1: float) -> str:
        """The text of the phrases the client plays (or will, or did) between ``t0`` and
        ``t1`` (``time.perf_counter()`` s) by the pacing clock of :meth:`played_by`: those
        whose audio overlaps that time, in order; empty before any audio."""
        if self._t_play is None:
            return ""
        t = self._t_play
        return " ".join(phrase for phrase, start, end in self._spans if t + start < t1 and t + end > t0)

    @property
    def paused(self) -> bool:
        """Its audio is paused (:meth:`pause`)."""
        return self._t_paused is not None

    def pause(self) -> bool:
        """Stop sending audio, keeping the rest of the reply, until :meth:`resume` (the text
        and the LLM go on). False, and nothing changes, if it is paused already or no audio
        was sent yet."""
        if self._t_paused is not None or self._t_play is None:
            return False
        now = time.perf_counter()
        self._t_paused = now
        self._ahead_at_pause = max(0.0, self.audio_s - (now - self._t_play))
        self._playing.clear()
        return True

    def resume(self) -> float | None:
        """Send the rest of the audio from where it stopped; returns how long it was paused
        (s), or None if it was not.

        The pacing clock (:meth:`_pace`) is shifted by the part of the pause that the
        client's buffer sat empty (the pause less the audio it had buffered, which it went on
        playing): the client is then assumed to hold what it really holds, and the lead is
        built up again as at the reply's start, never more than ``playback_lead_s``."""
        if self._t_paused is None or self._t_play is None:
            return None
        paused = time.perf_counter() - self._t_paused
        self._t_play += max(0.0, paused - self._ahead_at_pause)
        self._t_paused = None
        self._playing.set()
        return paused

    @property
    def queued(self) -> bool:
        """Its LLM request may still wait in the LLM's queue: submitted, not aborted, and
        neither a token nor an end yet (a request prefilling, or sent to a remote server,
        looks the same: an over-count by one, which the gate clamps)."""
        st = self._stream.stats if self._stream is not None else None
        return (st is not None and not self._aborted and st.finish_reason is None
                and st.ttft_ms == 0 and st.output_tokens == 0)

    async def run(self, user_text: str, *, t_end: float, asr_ms: float, language: str | None = None) -> None:
        """Generate, speak, and record the exchange; on cancel, record what was spoken.

        ``language``: the turn's (ISO code; None: unknown). Other than English (or English
        after another language), the user message asks for the reply in it
        (:func:`~pipeline.session.language.with_instruction`), and the history keeps the
        message as sent."""
        policy = self._policy()
        llm = self._llm(policy)
        t0 = time.perf_counter()
        specs = self.tools.specs if self.tools is not None and policy.stock_line is None else ()
        count = functools.partial(llm.count_tokens, tools=specs) if specs else llm.count_tokens
        demo = demo_exchange(specs)
        asking = with_instruction(user_text, language, (u for u, _ in self.history.turns))
        messages = await asyncio.to_thread(self.history.prompt, asking, count,
                                           policy.context_tokens - policy.max_new_tokens,
                                           demos=(demo,) if demo is not None else ())
        asked = messages[-1]["content"]  # the user message as it fit the context budget (and as sent)
        choice = self.tools.choice if specs and self.tools is not None else "auto"
        request = GenRequest(messages=messages, max_new_tokens=policy.max_new_tokens, session=self.session_id,
                             priority=PRIORITY_VOICE, tools=specs, tool_choice=choice)
        # may raise Busy: before response.started, so a refused reply leaves no open response
        try:
            stream: TextStream = stock_stream(policy.stock_line) if policy.stock_line is not None else \
                llm.submit(request)
        finally:
            if self.hooks.on_submit is not None:
                self.hooks.on_submit()
        self._stream = stream
        if specs and self.tools is not None:
            self.tool_turn = ToolTurn(llm=llm, request=request, tools=self.tools, cfg=self.cfg.tools, rid=self.rid,
                                      out=self.out, released=self._released, on_stream=self._next_stream)
        self.started = True
        await self.out.send(ev.ResponseStarted(response_id=self.rid, user_text=user_text, voice=self._voice_name))
        speaker = asyncio.create_task(self._speak(t0, t_end))
        try:
            text, fallback = await self._generate(stream)
            await speaker
            await self._released()
        except BaseException:
            self.abort_request()
            speaker.cancel()
            await asyncio.gather(speaker, return_exceptions=True)
            if self.release is None or self.release.is_set():  # a discarded speculation leaves no trace
                self.history.add_turn(asked, " ".join(self.spoken))
            raise
        st = stream.stats
        metrics.LLM_TTFT.observe(st.ttft_ms / 1000)
        if st.tpot_ms:
            metrics.LLM_TPOT.observe(st.tpot_ms / 1000)
        self.history.add_turn(asked, text)
        self._count_degraded(policy)
        output_tokens = st.output_tokens + (self.tool_turn.extra_tokens if self.tool_turn is not None else 0)
        if self.times is not None:
            self.times.reply_tokens.add(st.output_tokens)
            if st.prompt_tokens > 256:  # long enough that prefill, not queueing, dominates its TTFT
                self.times.prefill_token.add(st.ttft_ms / st.prompt_tokens)
        timings = {"asr": round(asr_ms, 1), "llm_ttft": round(st.ttft_ms, 1), "llm_tpot": round(st.tpot_ms, 1),
                   **self.timings}
        await self.out.send(ev.ResponseDone(response_id=self.rid, text=text,
                                            fallback=fallback or policy.stock_line is not None,
                                            text_only=self.text_only,
                                            finish_reason=_finish_reason(st.finish_reason),
                                            output_tokens=output_tokens, audio_s=round(self.audio_s, 3),
                                            timings_ms=timings, voice=self._voice_name))

    @property
    def _voice_name(self) -> str | None:
        return self.voice.name if self.voice is not None else None

    def _policy(self) -> TurnPolicy:
        """The governor's say on this reply, or normal service."""
        if self.governor is not None:
            return self.governor.turn_policy()
        return TurnPolicy(max_new_tokens=self.cfg.llm.max_new_tokens, context_tokens=self.cfg.llm.max_context_tokens)

    def _llm(self, policy: TurnPolicy) -> LlmStage:
        """The model that answers: the fallback when the policy says so and it is loaded
        (asking for it starts its loading), else the main one."""
        fallback = self.engines.fallback_llm
        if policy.fallback and fallback is not None:
            stage = fallback.get()
            if stage is not None:
                self.on_fallback = True
                return stage
        return self.engines.llm

    def _count_degraded(self, policy: TurnPolicy) -> None:
        if policy.stock_line is not None:
            metrics.DEGRADED_REPLIES.labels("stock_line").inc()
        elif self.on_fallback:
            metrics.DEGRADED_REPLIES.labels("fallback_model").inc()
        elif policy.max_new_tokens < self.cfg.llm.max_new_tokens:
            metrics.DEGRADED_REPLIES.labels("short").inc()
        if self.text_only:
            metrics.DEGRADED_REPLIES.labels("text_only").inc()
        if policy.reasons:
            logger.info("reply %d degraded: %s", self.rid, ", ".join(policy.reasons))

    def _next_stream(self, stream: TextStream) -> None:
        """A later round of a reply with tools: its request is the one to abort now."""
        self._stream = stream

    def _pieces(self, stream: TextStream) -> AsyncIterator[str]:
        """The reply's text as it comes: the stream's deltas, or with tools offered, the text
        to speak across the rounds of calls (:class:`~pipeline.session.tool_turn.ToolTurn`)."""
        return stream if self.tool_turn is None else self.tool_turn.pieces(stream)

    async def _generate(self, stream: TextStream) -> tuple[str, bool]:
        chunker = SentenceChunker()
        text = ""
        async for delta in self._pieces(stream):
            if self._t_first_token is None:
                self._t_first_token = time.perf_counter()
            text += delta
            await self.out.send(ev.ResponseTextDelta(response_id=self.rid, delta=delta))
            for phrase in chunker.push(delta):
                self._queue_phrase(phrase)
        for phrase in chunker.flush():
            self._queue_phrase(phrase)
        fallback = not speakable(text)
        if fallback:  # empty or unspeakable reply: say so rather than stay silent
            text = EMPTY_REPLY
            await self.out.send(ev.ResponseTextDelta(response_id=self.rid, delta=text))
            self._queue_phrase(text)
        self._phrases.put_nowait(None)
        return text, fallback

    def _queue_phrase(self, phrase: str) -> None:
        if self._t_first_phrase is None and speakable(phrase):
            self._t_first_phrase = time.perf_counter()
        self._phrases.put_nowait(phrase)

    async def _speak(self, t0: float, t_end: float) -> None:
        while (phrase := await self._phrases.get()) is not None:
            if not speakable(phrase) or self.text_only:
                continue
            try:
                # a reply's first phrase is what its user waits for; later ones have the
                # audio already playing as slack: the TTS stage serves first phrases first
                speech = await self.engines.tts.run(Phrase(phrase, self._voice_name), priority=1 if self.spoken else 0)
            except Busy as exc:
                if exc.reason != "breaker":
                    await self._tts_error(exc)
                    continue
                self.text_only = True  # the TTS breaker is open: the text goes on, without audio
                continue
            except Exception as exc:  # noqa: BLE001 - skip the phrase, keep speaking
                await self._tts_error(exc)
                continue
            if len(speech.audio) == 0:
                continue
            audio = await asyncio.to_thread(resample, speech.audio, speech.sample_rate, self.output_rate)
            self.spoken.append(phrase)
            self._spans.append((phrase, self.audio_s, self.audio_s + len(audio) / self.output_rate))
            step = int(self.output_rate * AUDIO_CHUNK_S)
            for i in range(0, len(audio), step):
                await self._playing.wait()  # paused: the rest waits here, from this chunk on
                await self._pace()
                while not self._playing.is_set():  # paused while it waited for its turn to go out
                    await self._playing.wait()
                    await self._pace()
                first = "first_audio" not in self.timings
                if first:
                    await self._released()
                now = time.perf_counter()
                chunk = audio[i : i + step]
                await self.out.audio(self.rid, float_to_pcm16(chunk))
                self.audio_s += len(chunk) / self.output_rate
                if first:  # counted once the frame went out: a reply cancelled before that is not
                    self._first_audio(now, t0, t_end, speech)

    async def _tts_error(self, exc: BaseException) -> None:
        """A phrase could not be spoken: its text stays, its audio is missing (``text_only``);
        the client hears of it once per reply (one ``tts_failed`` error)."""
        self.text_only = True
        if not self._tts_failed:
            self._tts_failed = True
            await self.error("tts_failed", f"could not speak a phrase (the reply goes on as text): {exc}")

    def _first_audio(self, now: float, t0: float, t_end: float, speech) -> None:
        """Record the reply's first audio (sent at ``now``): timings, metrics, callbacks."""
        # a speculative reply is measured from its confirmation, not its start
        self.timings["first_audio"] = round((now - max(t0, self._t_release)) * 1000, 1)
        self.timings["voice_to_voice"] = round((now - t_end) * 1000, 1)
        for key, mark in (("first_token_to_audio", self._t_first_token),
                          ("first_phrase_to_audio", self._t_first_phrase)):
            if mark is not None:
                self.timings[key] = round((now - max(mark, self._t_release)) * 1000, 1)
        synth_s, audio_s = speech.synth_ms / 1000, len(speech.audio) / speech.sample_rate
        self.timings["tts_rtf"] = round(synth_s / audio_s, 3)
        if self.times is not None:
            self.times.tts_phrase.add(speech.synth_ms)
        if self.hooks.on_first_audio is not None:
            self.hooks.on_first_audio(self.timings["voice_to_voice"])
        if self.governor is not None:
            self.governor.observe_v2v(self.timings["voice_to_voice"])
        if self.on_audio_start is not None:
            self.on_audio_start()
        metrics.FIRST_AUDIO.observe(now - max(t0, self._t_release))
        metrics.VOICE_TO_VOICE.observe(now - t_end)
        self._t_play = now

    async def _released(self) -> None:
        """Wait until a speculative reply is confirmed (no-op otherwise)."""
        if self.release is not None and not self.release.is_set():
            await self.release.wait()
            self._t_release = time.perf_counter()

    async def _pace(self) -> None:
        """Stay at most ``playback_lead_s`` ahead of real-time playback, so a barge-in
        silences the client quickly and nothing piles up in buffers."""
        if self._t_play is None:
            return
        ahead = self.audio_s - (time.perf_counter() - self._t_play)
        lead = self.cfg.tts.playback_lead_s
        if ahead > lead:
            await asyncio.sleep(ahead - lead)


WireFinish = Literal["stop", "length", "abort", "error"]
_WIRE_FINISH: dict[FinishReason, WireFinish] = {
    FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error"}


def _finish_reason(reason: FinishReason | None) -> WireFinish:
    """The wire value of an ended stream's finish reason (``stop`` if it gave none)."""
    return "stop" if reason is None else _WIRE_FINISH[reason]
