"""The work of a speech turn's end: its final transcript, then the start of its reply.

:class:`~pipeline.session.turn_runner.TurnRunner` decides when (and runs each in a task);
this does it: decode the final transcript (or make a speculation's decode final), report
it, start the reply (or let a speculation's held reply out).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Literal

from pipeline import metrics
from pipeline.asr.turn import AsrTurn
from pipeline.asr.types import Partial
from pipeline.errors import Busy
from pipeline.session import events as ev
from pipeline.session.gate import TurnGate
from pipeline.session.interruptions import Interruptions
from pipeline.session.replies import Replies, send_busy
from pipeline.session.speculation import Speculation
from pipeline.session.turn_ids import TurnIds
from pipeline.session.turn_state import TurnState
from pipeline.session.types import Outbox

logger = logging.getLogger(__name__)

REFUSED_DECODE_S = 5.0
"""Longest wait for a refused turn's background decode (s): past it, the words its partial
transcripts committed are told instead (the ASR stage is busy with turns being answered)."""


class TurnWork:
    """Final transcripts and reply starts of one session's speech turns.

    Args:
        out: the client's outbox.
        replies: the session's replies.
        gate: admission (each reply's hooks).
        ids: the turns' ids.
        turn_state: told when a turn had no words.
        barge: speech over the reply: a turn spoken over one that was only a backchannel
            ends without a reply (``turn.empty`` ``backchannel``).
        error: ``error(code, message)`` reports to the client.
        session_id: for logs.
    """

    def __init__(self, *, out: Outbox, replies: Replies, gate: TurnGate, ids: TurnIds, turn_state: TurnState,
                 error: Callable[[ev.ErrorCode, str], Awaitable[None]], session_id: str,
                 barge: Interruptions | None = None) -> None:
        self.out, self.replies, self.gate, self.ids, self.turn_state = out, replies, gate, ids, turn_state
        self.error, self.id, self.barge = error, session_id, barge

    async def transcribe_and_reply(self, turn: AsrTurn, t_end: float, *, key: object | None = None) -> None:
        """Decode the turn's final transcript, report it and start its reply (see
        :meth:`decode` and :meth:`reply`)."""
        result = await self.decode(turn)
        if result is not None:
            await self.reply(turn, result, t_end, key=key)

    async def decode(self, turn: AsrTurn) -> Partial | None:
        """Decode the turn's final transcript; None when there is none (a refused decode is
        reported with ``busy``, a failed one with ``error`` ``asr_failed``)."""
        try:
            return await turn.finish()
        except Busy as exc:
            await send_busy(self.out, exc, turn_id=self.ids.of(turn))
        except Exception as exc:
            logger.exception("session %s: ASR failed", self.id)
            await self.error("asr_failed", f"transcription failed: {exc}")
        return None

    async def reply(self, turn: AsrTurn, result: Partial, t_end: float, *, key: object | None = None) -> None:
        """Report the turn's final transcript ``result`` and start its reply (``key``: the
        turn admission admitted, when it is not ``turn`` itself)."""
        if await self.final_transcript(turn, result):
            await self.replies.begin(result.text, turn_id=self.ids.of(turn), t_end=t_end, asr_ms=turn.last_decode_ms,
                                     hooks=self.gate.hooks(turn if key is None else key), language=result.language)

    async def final_transcript(self, turn: AsrTurn, result: Partial) -> bool:
        """Report the turn's final transcript; False (and ``turn.empty``) if it has no words,
        or if it was spoken over a reply and is only a backchannel or the reply's own echo
        (the reply goes on)."""
        audio_s = turn.stream.total_s
        metrics.ASR_SECONDS.observe(turn.decode_ms / 1000)
        if audio_s > 0:
            metrics.ASR_RTF.observe(turn.decode_ms / 1000 / audio_s)
        heard = await self.barge.final(turn, result.text, result.language) if self.barge is not None else None
        if not result.text or heard in ("backchannel", "echo"):
            self.turn_state.turn_empty()
            reason: Literal["backchannel", "echo", "no_words"] = \
                "no_words" if not result.text else "echo" if heard == "echo" else "backchannel"
            await self.out.send(ev.TurnEmpty(turn_id=self.ids.of(turn), reason=reason))
            return False
        await self.out.send(self._final(turn, result, audio_s))
        return True

    def _final(self, turn: AsrTurn, result: Partial, audio_s: float, *, unanswered: bool = False,
               source: ev.TranscriptSource = "asr") -> ev.TranscriptFinal:
        """The ``transcript.final`` of speech turn ``turn`` (``audio_s``: its length, s)."""
        turn_id = self.ids.of(turn)
        return ev.TranscriptFinal(turn_id=turn_id, continues_turn_id=self.ids.joined_to(turn_id), text=result.text,
                                  language=result.language, audio_ms=int(audio_s * 1000), unanswered=unanswered,
                                  source=source)

    async def unanswered(self, turn: AsrTurn, *, decode: bool) -> Partial | None:
        """Report the final transcript of a turn admission refused (its ``busy`` went out):
        ``unanswered``, no reply follows. Decoded at background priority if ``decode``
        (within :data:`REFUSED_DECODE_S`, after :meth:`AsrTurn.end_input`); else, or when that
        decode is refused, fails or is late, the words its partials committed (``source``
        ``partial``). Nothing when it has no words. Returns what was reported."""
        result: Partial | None = None
        if decode:
            try:
                result = await asyncio.wait_for(turn.finish(background=True), REFUSED_DECODE_S)
            except Exception as exc:  # noqa: BLE001 - Busy, a timeout, a failed decode: the committed words instead
                logger.info("session %s: no final decode for a refused turn (%s): its committed words instead",
                            self.id, repr(exc))
        source: ev.TranscriptSource = "asr"
        if result is None:
            result, source = turn.committed(), "partial"
        if not result.text:
            return None
        await self.out.send(self._final(turn, result, turn.stream.total_s, unanswered=True, source=source))
        return result

    async def speculate(self, spec: Speculation, drop_tail: int) -> None:
        """Decode ``spec``'s turn as the final would (leaving out ``drop_tail`` samples of
        pause) without committing it; if it has words, start its reply, held in
        ``spec.outbox``."""
        try:
            spec.peek = await spec.turn.peek_final(drop_tail=drop_tail)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.debug("session %s: no speculation", self.id, exc_info=True)
            return
        text = spec.peek[0].text if spec.peek is not None else ""
        if text and spec.peek is not None:
            spec.resp = self.replies.new(out=spec.outbox, release=spec.outbox.released)
            self.replies.run(spec.resp, text, turn_id=self.ids.of(spec.turn), t_end=spec.t_end,
                             asr_ms=spec.turn.last_decode_ms, hooks=self.gate.hooks(spec.turn),
                             language=spec.peek[0].language)

    async def confirm(self, spec: Speculation) -> None:
        """The turn ended where the speculation decoded it: make its transcript final
        and let its reply out (or fall back to a normal final decode)."""
        promoted = False
        try:
            if spec.task is not None:
                await asyncio.gather(spec.task, return_exceptions=True)
            if spec.peek is None or spec.turn.decoding:  # no peek, or the buffer moved on since
                metrics.SPECULATIONS.labels("failed").inc()
                await self.transcribe_and_reply(spec.turn, spec.t_end)
                return
            metrics.SPECULATIONS.labels("used").inc()
            _, req, result = spec.peek
            final = spec.turn.commit_final(req, result)
            if not await self.final_transcript(spec.turn, final):
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
