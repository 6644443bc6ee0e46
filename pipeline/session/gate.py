"""A session's side of admission: ask the server's :class:`~pipeline.serving.admission.Admission`
about each turn as it ends, count the decision, and release an admitted turn once its LLM
request is queued (until then it counts as waiting, so that a burst of turns ending
together does not all see an empty queue)."""

from __future__ import annotations

import dataclasses
import logging
import time

from pipeline import metrics
from pipeline.config import VoxpipeConfig
from pipeline.engines import Engines
from pipeline.serving.admission import Admission, Refusal, ServiceTimes
from pipeline.serving.governor import Governor
from pipeline.session.types import TurnHooks

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4
"""English text averages about 4 characters per BPE token (OpenAI's rule of thumb): a
prompt's size is estimated without tokenizing it (a refused turn costs no tokenization)."""
CHARS_PER_SPEECH_S = 16
"""Transcript characters per second of speech (about 160 words a minute)."""


NO_DECODE_REASONS: frozenset[str] = frozenset({"rate_limited", "ladder", "breaker"})
"""Refusals after which a refused turn's final transcript is not decoded (its committed
words are told instead): the client's audio is what costs (``rate_limited``), or the
server is degraded (``ladder``: a stage ran out of memory; ``breaker``: for a spoken turn,
the ASR stage is failing)."""


class TurnGate:
    """Admission for one session's turns.

    Args:
        admission: the server's policy, shared by its sessions (None: admit everything).
        engines: read for the stages' queues (:meth:`~pipeline.engines.Engines.load`).
        cfg: the configuration (the LLM's prompt budget bounds a request's KV tokens).
        session_id: for logs.
        governor: the server's service level: an out-of-memory ladder at step 2 or an open
            ASR breaker refuses turns first (None: no such refusals).
    """

    def __init__(self, admission: Admission | None, engines: Engines, cfg: VoxpipeConfig, session_id: str,
                 governor: Governor | None = None) -> None:
        self.admission, self.engines, self.cfg, self.id = admission, engines, cfg, session_id
        self.governor = governor
        self._over_budget_until = 0.0  # time.monotonic(): the client sends faster than its budget
        self._own: set[object] = set()  # keys of this session's turns admitted and still counted
        self._waited: dict[object, float] = {}  # admitted turn → silence its policy waited (ms)

    def over_budget(self, for_s: float) -> None:
        """The client is sending faster than its input budget (server/budget.py): its turns
        are refused (``busy`` ``rate_limited``) for the next ``for_s`` seconds — a client
        beyond real time is not a conversation, and its replies would cost other sessions."""
        self._over_budget_until = max(self._over_budget_until, time.monotonic() + for_s)

    @property
    def is_over_budget(self) -> bool:
        """The client is over its input budget now: its partial transcripts are held as
        while the server refuses turns (:meth:`hold_ms`), its VAD-ended turns refused."""
        return time.monotonic() < self._over_budget_until

    @property
    def times(self) -> ServiceTimes | None:
        """The measured service times replies feed (None without admission)."""
        return self.admission.times if self.admission is not None else None

    def check(self, *, spoken: bool, since_end_ms: float, key: object = None, count: bool = True,
              prompt_chars: int = 0, client_ended: bool = False, own_asr: int = 0,
              own_llm: int = 0, waited_ms: float = 0.0) -> Refusal | None:
        """Admit (None) or refuse a turn that ends now.

        Args:
            spoken: a spoken turn (False: typed).
            since_end_ms: time already gone since the end of the user's speech (ms; it is
                part of voice-to-voice).
            key: the admitted turn counts as queued for the LLM until :meth:`hooks`'
                ``on_submit`` for it runs (its request was submitted) or it expires.
            count: False for a look-ahead that decides nothing (whether to speculate).
            prompt_chars: characters of the prompt past the system prompt (history and
                the turn's text; for speech, :data:`CHARS_PER_SPEECH_S` per second).
            client_ended: the client ended this spoken turn (``input.end``: a file sent
                fast, push-to-talk), which an over-budget client may still do (its input was
                paced); the turns VAD ends while it is over budget are refused.
            own_asr: urgent ASR requests of this very turn awaiting the engine (its
                speculative final decode, a catch-up): the turn's own work, not others'
                it would wait behind, so they are taken off the ASR queue's depth. Counted,
                they made a session alone on the server look busy to itself.
            own_llm: this session's LLM requests waiting in the LLM's queue (an earlier
                turn's reply or a speculation's, :meth:`Replies.queued`): the turn's reply
                replaces them, so they are taken off the LLM queue's depth; likewise this
                session's earlier admitted turns are not counted as others waiting.
            waited_ms: silence an end-of-turn policy waited beyond the silence rule (already
                left out of ``since_end_ms``): the admitted turn's first audio is measured
                without it too, so the user's thinking pause never reads as a late reply.
        """
        left_s = self._over_budget_until - time.monotonic()  # see is_over_budget
        if left_s > 0 and not client_ended:
            if count:
                logger.info("session %s: turn refused: the client sends faster than its budget", self.id)
            return Refusal(reason="rate_limited", retry_after_ms=round(left_s * 1000), predicted_ms=0.0,
                           message="this session sends faster than its budget allows (rate_limited): its turns "
                                   "are not answered until it slows down")
        degraded = self.governor.refusal(spoken=spoken) if self.governor is not None else None
        if degraded is not None:
            if count:
                logger.info("session %s: turn refused (%s): %s", self.id, degraded.reason, degraded)
            return Refusal(reason=degraded.reason, retry_after_ms=degraded.retry_after_ms, predicted_ms=0.0,
                           message=str(degraded))
        admission = self.admission
        if admission is None:
            return None
        load, now = self.engines.load(self.cfg), time.monotonic()
        if own_asr or own_llm:
            load = dataclasses.replace(load, asr_waiting=max(0, load.asr_waiting - own_asr),
                                       llm_waiting=max(0, load.llm_waiting - own_llm))
        self._own = {k for k in self._own if admission.holds(k)}
        pending = admission.pending(now)
        prompt_tokens = min(self.cfg.llm.max_context_tokens, prompt_chars // CHARS_PER_TOKEN)
        refusal = admission.decide(load, spoken=spoken, end_silence_ms=since_end_ms,
                                   kv_tokens=self.cfg.llm.max_context_tokens, now=now, key=key, count=count,
                                   prompt_tokens=prompt_tokens, own=self._own)
        if refusal is None and key is not None:
            self._own.add(key)
            if waited_ms > 0:
                self._waited[key] = waited_ms
        if count:
            predicted = admission.corrected_ms(load, spoken=spoken, end_silence_ms=since_end_ms, pending=pending,
                                               prompt_tokens=prompt_tokens)
            metrics.PREDICTED.observe(predicted / 1000)
            if refusal is None:
                metrics.ADMISSIONS.labels("admitted", "").inc()
            else:
                logger.info("session %s: turn refused (%s): %s", self.id, refusal.reason, refusal.message)
                logger.debug("session %s: refused at %s, pending %d, critical %d", self.id, load, pending,
                             admission.critical(now))
        return refusal

    def decodes_refused(self, refusal: Refusal, *, own_asr: int = 0) -> bool:
        """Whether a spoken turn refused with ``refusal`` may still have its final
        transcript decoded, at background priority (after every other decode): not after
        the refusals in :data:`NO_DECODE_REASONS`, nor while other turns' final decodes wait
        at the ASR stage (it is the stage short of time: the decode would only add to it).
        ``own_asr``: as for :meth:`check`."""
        if refusal.reason in NO_DECODE_REASONS:
            return False
        return self.engines.load(self.cfg).asr_waiting - own_asr <= 0

    def admitted_earlier(self, key: object = None, *, waited_ms: float = 0.0) -> None:
        """Count a turn admitted by an earlier look-ahead (a speculation already running;
        ``waited_ms`` as for :meth:`check`)."""
        if self.admission is not None:
            if key is not None and waited_ms > 0:
                self._waited[key] = waited_ms
            self.admission.admitted += 1
            metrics.ADMISSIONS.labels("admitted", "").inc()

    def hooks(self, key: object) -> TurnHooks:
        """The callbacks a reply to ``key``'s turn calls: its LLM request was submitted
        (it no longer counts as pending), its first audio went out (admission learns the
        actual voice-to-voice time, ms, against its prediction), it ended (however: a
        reply cancelled before its first audio no longer counts as waiting). Empty
        without admission."""
        admission = self.admission
        if admission is None:
            return TurnHooks()

        def report(ms: float) -> None:
            waited = self._waited.pop(key, 0.0)
            admission.observe(key, ms - waited, time.monotonic())
            logger.info("session %s: first audio %.0f ms after the end of speech (%.0f ms of it a chosen wait; "
                        "admission: limit %.1f, correction %.2f)", self.id, ms, waited, admission.limit,
                        admission.correction.value)

        def end() -> None:
            self._waited.pop(key, None)
            admission.forget(key)
        return TurnHooks(on_submit=lambda: admission.release(key), on_first_audio=report, on_end=end)

    def release(self, key: object) -> None:
        """``key``'s turn ended without a reply in flight: it is neither pending nor
        critical any more (idempotent)."""
        self._waited.pop(key, None)
        if self.admission is not None:
            self.admission.forget(key)

    def close(self) -> None:
        """The session closed: none of its admitted turns counts as pending or critical
        any more (a reply stopped mid-way never calls its hooks' ``on_end``)."""
        if self.admission is not None:
            for key in self._own:
                self.admission.forget(key)
        self._own.clear()
        self._waited.clear()

    def hold_ms(self) -> float:
        """How long best-effort work (a session's partial transcripts) may be put off now
        (ms; 0: not at all): ``partial_hold_overload_ms`` while the server refuses turns or
        this client is over its input budget, ``partial_hold_max_ms`` while admitted users
        wait for their first audio."""
        if self.is_over_budget:
            return float(self.cfg.asr.partial_hold_overload_ms)
        admission = self.admission
        if admission is None:
            return 0.0
        now = time.monotonic()
        if admission.overloaded(now):
            return float(self.cfg.asr.partial_hold_overload_ms)
        return float(self.cfg.asr.partial_hold_max_ms) if admission.critical(now) > 0 else 0.0
