"""Admission control: refuse a turn at once when its reply would miss the latency SLO.

A pure policy (no I/O, no clock): the session asks :meth:`Admission.decide` at the end of
a user's speech — before the final transcript, the prompt's tokenization, the LLM prefill
or any TTS — with a :class:`Load` snapshot of the stages. The prediction adds up what the
turn will wait for, each term from a moving estimate of a measured service time
(:class:`ServiceTimes`, fed as turns complete):

    predicted = end_silence                                  (counted in voice-to-voice)
              + asr_final × (1 + asr_waiting // asr_batch)    (each full batch ahead ≈ one decode)
              + slot_wait                                     (0 while a batch slot is free)
              + (prefill_steps + first_phrase_tokens) × llm_step
              + max(0, prompt_tokens − base_prompt_tokens) × prefill_token
              + tts_phrase × (1 + tts_waiting // tts_workers)

    slot_wait = (1 + (llm_waiting − free_slots) // slots) × hold,  when llm_waiting ≥ free_slots
    hold      = reply_tokens × llm_step                       (how long a request keeps its slot)

``llm_step`` is the engine's measured time per step at its current batch, so a fuller batch
predicts slower tokens. ``prompt_tokens`` is estimated without tokenizing (characters ÷ 4 of
the history and the typed text, or 4 tokens per second of speech): a long typed question
predicts its long prefill, so one session's appetite is refused rather than charged to
everyone's latency. ``llm_waiting`` also counts the turns admitted but not yet
submitted to the LLM (their final transcript is still being decoded): without them, a
burst of turns ending together would all see an empty queue and all be admitted.

The sum but its silence (already gone: a fact, not an estimate) is scaled by a learned
``correction``: the ``correction_quantile`` (0.9) of the recent actual ÷ predicted ratios
of admitted turns' service times (end of turn → first audio, reported at their first
audio; a mean until 8 are known). Partial transcripts and later phrases of replies do
not count as waiting work: the stages serve a turn's final transcript and first phrase
before them (:meth:`~pipeline.worker.BatchWorker.priority`). On a 2-core CPU the stages mostly slow each other down
(contention) rather than queue, which the sum alone underestimates, and the SLO is about
the tail, so the quantile, not the mean. A turn whose corrected prediction exceeds
``headroom`` (0.85) × ``slo_ms`` gets ``busy`` with reason ``queue`` and ``retry_after_ms`` ≈ the excess.

A prediction from the queues now cannot see the turns admitted a moment later, which
will compete for the same cores. So admission also keeps a **concurrency limit**: at
most ``limit`` admitted turns may be waiting for their first audio at once. The limit
adapts by AIMD, as TCP's congestion window and Netflix's concurrency-limits do: an
admitted turn whose first audio comes later than ``headroom`` × ``slo_ms`` (a miss, or
nearly one: the limit backs off before users see misses, as delay-based congestion
control such as TCP Vegas does) multiplies it by ``limit_backoff`` (at most once per
SLO period), one that comes sooner adds ``1 / limit`` (about +1 per limit's worth of
turns) — but only if at least half the limit was in use when it was admitted (as
Netflix's AIMDLimit and RFC 7661's congestion-window validation do): a light load proves
nothing about a bigger burst, and a limit grown by it would admit that burst whole.

Neither rule refuses a turn while the server is idle (no other user waiting for a first
audio, nothing queued; replies already playing only share decode steps): refusing it
could not make anyone faster; on a slow machine the SLO is then
missed by the machine, not by load. A turn that would overflow the LLM's KV budget gets
reason ``memory``. The rule of admission control: refuse early, before work is spent, rather
than queue into tens of seconds (docs/ARCHITECTURE.md, admission and degradation).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple

from pipeline.config import AdmissionConfig
from pipeline.errors import Busy, BusyReason
from pipeline.serving.types import StageLoad


@dataclass(slots=True, frozen=True)
class Load:
    """The stages' queues when a turn ends (:meth:`of` the stages' :class:`StageLoad` s).

    Attributes:
        asr_waiting: ASR requests queued. asr_batch: most decodes run together.
        llm_waiting: LLM requests waiting for a batch slot. llm_running: requests in the
            batch. llm_slots: the batch's size.
        kv_reserved: KV-cache tokens the LLM's requests hold (prompt + max new tokens,
            each). kv_budget: the LLM's KV budget in tokens.
        llm_step_ms: the LLM engine's measured time per step now (0: not known yet; the
            moving estimate in :class:`ServiceTimes` is used instead).
        tts_waiting: TTS jobs queued. tts_workers: synthesizer threads.
    """

    asr_waiting: int = 0
    asr_batch: int = 8
    llm_waiting: int = 0
    llm_running: int = 0
    llm_slots: int = 8
    kv_reserved: int = 0
    kv_budget: int = 1 << 30
    llm_step_ms: float = 0.0
    tts_waiting: int = 0
    tts_workers: int = 1

    @classmethod
    def of(cls, asr: StageLoad, llm: StageLoad, tts: StageLoad, *, asr_batch: int, tts_workers: int) -> Load:
        """The turn's view of the stages' snapshots (``stage.load()``). ASR and TTS count
        only their urgent work: partial transcripts and later phrases wait behind a turn's
        final transcript and first phrase, so they do not delay it; every LLM request is urgent.

        Args:
            asr_batch: most decodes the ASR runs together. tts_workers: synthesizer threads.
        """
        return cls(asr_waiting=asr.urgent_depth, asr_batch=asr_batch, llm_waiting=llm.depth, llm_running=llm.active,
                   llm_slots=llm.slots, kv_reserved=llm.kv_reserved, kv_budget=llm.kv_budget,
                   llm_step_ms=llm.step_ms, tts_waiting=tts.urgent_depth, tts_workers=tts_workers)


@dataclass(slots=True)
class Ewma:
    """Exponentially weighted moving average starting from a prior.

    Attributes:
        value: the current estimate. alpha: weight of a new sample (0..1].
    """

    value: float
    alpha: float = 0.2

    def add(self, sample: float) -> None:
        """Fold in one finite, non-negative sample (others are ignored)."""
        if math.isfinite(sample) and sample >= 0:
            self.value += self.alpha * (sample - self.value)


@dataclass(slots=True)
class RatioQuantile:
    """A quantile of the last ``window`` samples (a mean until ``min_samples`` are known;
    ``1.0`` before any).

    Attributes:
        q: the quantile (0..1). value: the current estimate.
    """

    q: float = 0.9
    window: int = 32
    min_samples: int = 8
    _xs: deque[float] = field(default_factory=deque)

    def add(self, sample: float) -> None:
        """Fold in one finite, positive sample (others are ignored)."""
        if math.isfinite(sample) and sample > 0:
            self._xs.append(sample)
            while len(self._xs) > self.window:
                self._xs.popleft()

    @property
    def value(self) -> float:
        xs = self._xs
        if not xs:
            return 1.0
        if len(xs) < self.min_samples:
            return sum(xs) / len(xs)
        ordered = sorted(xs)
        return ordered[min(len(ordered) - 1, int(self.q * len(ordered)))]


@dataclass(slots=True)
class ServiceTimes:
    """Moving estimates of the service times the prediction uses (ms unless noted),
    seeded with the priors of :class:`~pipeline.config.AdmissionConfig`.

    Attributes:
        asr_final: one final decode. llm_step: one LLM engine step at the current batch.
        tts_phrase: synthesis of a reply's first phrase. reply_tokens: tokens per reply.
        prefill_token: prefill time per prompt token (from long prompts' time to first token).
    """

    asr_final: Ewma
    llm_step: Ewma
    tts_phrase: Ewma
    reply_tokens: Ewma
    prefill_token: Ewma

    @classmethod
    def from_config(cls, cfg: AdmissionConfig) -> ServiceTimes:
        return cls(asr_final=Ewma(cfg.prior_asr_ms), llm_step=Ewma(cfg.prior_llm_step_ms),
                   tts_phrase=Ewma(cfg.prior_tts_ms), reply_tokens=Ewma(cfg.prior_reply_tokens),
                   prefill_token=Ewma(cfg.prior_prefill_ms_per_token))


@dataclass(slots=True, frozen=True)
class Refusal:
    """Why a turn is refused: ``reason`` (``queue`` | ``memory``), ``retry_after_ms``,
    and the ``predicted_ms`` time to first audio that missed the SLO."""

    reason: BusyReason
    retry_after_ms: int
    predicted_ms: float
    message: str

    def as_busy(self) -> Busy:
        """The refusal as the :class:`~pipeline.errors.Busy` a stage would raise."""
        return Busy(self.message, reason=self.reason, retry_after_ms=self.retry_after_ms)


class Prediction(NamedTuple):
    """What admission predicted for an admitted turn, kept until its first audio."""

    service_ms: float  # the predicted service time (all but the silence)
    silence_ms: float  # the end-of-turn silence already gone
    expires: float  # when to forget it (monotonic s)
    late: bool  # predicted over the SLO (admitted only because the server was idle)
    limit_used: bool  # at least half the concurrency limit was in use at its admission


@dataclass(slots=True)
class Admission:
    """The process-wide admission policy (one per server, shared by its sessions).

    Args:
        cfg: the SLO, the priors and whether admission is on.
    """

    cfg: AdmissionConfig
    times: ServiceTimes = field(init=False)
    admitted: int = 0
    refused: int = 0
    correction: RatioQuantile = field(init=False)
    limit: float = field(init=False)  # admitted turns waiting for their first audio, at most
    loop_lag: Ewma = field(default_factory=lambda: Ewma(0.0, alpha=0.1))  # the event loop's lag (ms)
    _last_backoff: float = -math.inf  # when the limit last shrank (s)
    _last_refusal: float = -math.inf  # when a turn was last refused (s)
    _pending: dict[object, float] = field(default_factory=dict)  # admitted turn → expiry (s)
    _critical: dict[object, float] = field(default_factory=dict)  # admitted, first audio not out → expiry
    _predicted: dict[object, Prediction] = field(default_factory=dict)  # admitted turn → its prediction

    def __post_init__(self) -> None:
        self.times = ServiceTimes.from_config(self.cfg)
        self.correction = RatioQuantile(q=self.cfg.correction_quantile)
        self.limit = self.cfg.initial_limit

    def pending(self, now: float) -> int:
        """Admitted turns not yet submitted to the LLM (expired entries dropped)."""
        for key in [k for k, exp in self._pending.items() if exp <= now]:
            del self._pending[key]
        for key in [k for k, p in self._predicted.items() if p.expires <= now]:
            del self._predicted[key]
        return len(self._pending)

    def critical(self, now: float) -> int:
        """Admitted turns whose reply's first audio is not out yet: users waiting now
        (an entry expires 2 × ``slo_ms`` after admission, should its end be missed)."""
        for key in [k for k, exp in self._critical.items() if exp <= now]:
            del self._critical[key]
        return len(self._critical)

    def overloaded(self, now: float) -> bool:
        """A turn was refused (or would have been) within the last ``overload_s``."""
        return now - self._last_refusal < self.cfg.overload_s

    def observe(self, key: object, actual_ms: float, now: float = 0.0) -> None:
        """The admitted turn ``key`` reached its first audio ``actual_ms`` after its end
        (at ``now``, monotonic s): learn how far off the prediction was (ratio clamped to
        0.5..4) and adapt the concurrency limit. Unknown keys are ignored."""
        self._critical.pop(key, None)
        entry = self._predicted.pop(key, None)
        if entry is None:
            return
        if entry.service_ms > 0:
            self.correction.add(min(4.0, max(0.5, (actual_ms - entry.silence_ms) / entry.service_ms)))
        c = self.cfg
        if entry.late:
            return
        if actual_ms > c.headroom * c.slo_ms:  # a miss, or about to be: back off before users see one
            if now - self._last_backoff >= c.slo_ms / 1000:  # one backoff per SLO period
                self.limit = max(1.0, self.limit * c.limit_backoff)
                self._last_backoff = now
        elif entry.limit_used:
            self.limit = min(c.max_limit, self.limit + 1.0 / self.limit)

    def release(self, key: object) -> None:
        """The admitted turn ``key`` reached the LLM's queue (or ended without a reply):
        it no longer counts as pending. Idempotent; unknown keys are ignored."""
        self._pending.pop(key, None)

    def forget(self, key: object) -> None:
        """The admitted turn ``key`` ended without (or after) its reply's first audio:
        it is neither pending nor critical any more. Idempotent."""
        self._pending.pop(key, None)
        self._critical.pop(key, None)
        self._predicted.pop(key, None)

    def predict_ms(self, load: Load, *, spoken: bool, end_silence_ms: float, pending: int = 0,
                   prompt_tokens: int = 0) -> float:
        """Predicted time from the end of the user's turn to the reply's first audio (ms).

        ``spoken``: a spoken turn (a final decode and the end-of-turn silence count);
        False for a typed one. ``pending``: admitted turns not yet in the LLM's queue.
        ``prompt_tokens``: the turn's prompt past the cached system prompt (an estimate;
        tokens beyond ``base_prompt_tokens`` add their prefill time).
        """
        t, c = self.times, self.cfg
        step = load.llm_step_ms or t.llm_step.value
        ms = 0.0
        if spoken:
            ms += end_silence_ms + t.asr_final.value * (1 + load.asr_waiting // max(1, load.asr_batch))
        free = max(0, load.llm_slots - load.llm_running)
        waiting = load.llm_waiting + pending
        if waiting >= free:
            rounds = 1 + (waiting - free) // max(1, load.llm_slots)
            ms += rounds * t.reply_tokens.value * step
        ms += (c.prefill_steps + c.first_phrase_tokens) * step
        ms += max(0, prompt_tokens - c.base_prompt_tokens) * t.prefill_token.value
        ms += t.tts_phrase.value * (1 + load.tts_waiting // max(1, load.tts_workers))
        return ms

    def corrected_ms(self, load: Load, *, spoken: bool, end_silence_ms: float, pending: int = 0,
                     prompt_tokens: int = 0) -> float:
        """:meth:`predict_ms` with its service part (all but the silence already gone,
        which is a fact, not an estimate) scaled by the learned ``correction``, plus the
        event loop's lag (the server measures a turn from when its loop saw the end of
        speech: audio waiting for a late loop is invisible to the correction)."""
        silence = end_silence_ms if spoken else 0.0
        raw = self.predict_ms(load, spoken=spoken, end_silence_ms=end_silence_ms, pending=pending,
                              prompt_tokens=prompt_tokens)
        return silence + self.loop_lag.value + self.correction.value * (raw - silence)

    def note_loop_lag(self, lag_ms: float) -> None:
        """One event-loop lag sample (ms), from :class:`~pipeline.serving.loop_lag.LoopLag`."""
        self.loop_lag.add(lag_ms)

    def holds(self, key: object) -> bool:
        """``key``'s admitted turn still counts as pending or critical."""
        return key in self._pending or key in self._critical

    def decide(self, load: Load, *, spoken: bool, end_silence_ms: float, kv_tokens: int, now: float,
               key: object = None, count: bool = True, prompt_tokens: int = 0,
               own: Collection[object] = ()) -> Refusal | None:
        """Admit (None) or refuse (a :class:`Refusal`) a turn; counts both unless ``count``
        is False (a look-ahead, e.g. whether to start a speculation). An admitted turn with
        a ``key`` counts as pending (queued for the LLM) until :meth:`release` or
        ``pending_ttl_s`` after ``now``, and as critical (waiting for its first audio)
        until :meth:`observe` or :meth:`forget` — also when not counted: a speculation
        holds its place while it runs.

        Args:
            load: the stages now.
            spoken: a spoken turn (False: typed).
            end_silence_ms: the silence that ended the turn (part of voice-to-voice).
            kv_tokens: the most KV-cache tokens the turn's LLM request can hold (its
                prompt budget + max new tokens: known without tokenizing anything).
            now: a monotonic clock (s), for pending turns' expiry.
            prompt_tokens: the turn's prompt past the cached system prompt (an estimate).
            own: keys of the same session's other admitted turns: its reply replaces
                theirs, so they are not counted as others waiting.
        """
        # a turn never waits behind itself (its own speculation may hold a place under its
        # key) nor behind its session's earlier turns
        mine = {k for k in (key, *own) if k is not None}
        pending = self.pending(now) - sum(k in self._pending for k in mine)
        critical = self.critical(now) - sum(k in self._critical for k in mine)
        refusal = self._refusal(load, spoken, end_silence_ms, kv_tokens, pending, critical, prompt_tokens)
        if count:
            self.admitted += refusal is None
            self.refused += refusal is not None
        if refusal is not None:
            self._last_refusal = now
        if refusal is None and key is not None:  # (a speculation reserves its place uncounted)
            self._pending[key] = now + self.cfg.pending_ttl_s
            self._critical[key] = now + 2 * self.cfg.slo_ms / 1000
            silence = end_silence_ms if spoken else 0.0
            others = self.pending(now) - 1
            raw = self.predict_ms(load, spoken=spoken, end_silence_ms=end_silence_ms, pending=others,
                                  prompt_tokens=prompt_tokens)
            # a turn admitted although predicted over the SLO (an idle server) teaches the
            # correction, but its miss is no surprise: it does not shrink the limit
            late = self.corrected_ms(load, spoken=spoken, end_silence_ms=end_silence_ms, pending=others,
                                     prompt_tokens=prompt_tokens) > self.cfg.slo_ms
            used = 2 * self.critical(now) >= self.limit  # (the critical count includes this turn)
            self._predicted[key] = Prediction(raw - silence, silence, now + 6 * self.cfg.pending_ttl_s, late, used)
        return refusal

    def _refusal(self, load: Load, spoken: bool, end_silence_ms: float, kv_tokens: int,
                 pending: int, critical: int, prompt_tokens: int) -> Refusal | None:
        if not self.cfg.enabled:
            return None
        refusal: Refusal | None = None
        predicted = self.corrected_ms(load, spoken=spoken, end_silence_ms=end_silence_ms, pending=pending,
                                      prompt_tokens=prompt_tokens)
        # nobody else waits for a first audio (replies already playing only share decode steps)
        idle = not (load.asr_waiting or load.tts_waiting or load.llm_waiting or pending or critical)
        slo = self.cfg.slo_ms
        if load.kv_reserved + kv_tokens > load.kv_budget and load.llm_running > 0:
            hold = self.times.reply_tokens.value * (load.llm_step_ms or self.times.llm_step.value)
            refusal = Refusal("memory", _retry(hold), predicted,
                              f"the LLM's KV budget is full ({load.kv_reserved} of {load.kv_budget} tokens held)")
        elif predicted > self.cfg.headroom * slo and not idle:
            refusal = Refusal("queue", _retry(predicted - self.cfg.headroom * slo), predicted,
                              f"a reply now would take ~{predicted:.0f} ms, too close to the {slo:.0f} ms SLO")
        elif critical >= int(self.limit) and not idle:
            refusal = Refusal("queue", _retry(predicted / 2), predicted,
                              f"{critical} turns are already waiting for their reply (limit {int(self.limit)})")
        return refusal


def _retry(ms: float) -> int:
    """A retry hint: at least 100 ms, rounded up to 100 ms."""
    return int(max(100.0, math.ceil(ms / 100.0) * 100.0))
