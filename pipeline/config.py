"""Typed configuration: one :class:`VoxpipeConfig` composed of per-stage configs.

Every field has a documented default; :meth:`VoxpipeConfig.validate` cross-checks them
and raises ``ValueError`` with a clear message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.serving_config import AdmissionConfig, DegradeConfig, ServerConfig, is_loopback


@dataclass(slots=True, kw_only=True)
class TurnConfig:
    """VAD turn detection (endpointing).

    Attributes:
        threshold: Silero speech probability that starts speech (0.5, Silero's default).
        neg_threshold: probability under which a window counts as silence (threshold − 0.15,
            as in faster-whisper's VadOptions).
        min_speech_ms: speech shorter than this is dropped as a click or cough (250 ms).
        end_silence_ms: silence that ends a turn (500 ms).
        early_end_ms: after this much silence the final transcript and the reply start
            speculatively (200 ms; 0 = off). Nothing of it reaches the client until the
            turn really ends (``end_silence_ms`` or ``input.end``); speech that resumes
            first discards it. Voice-to-voice latency drops by up to the difference.
        pad_ms: audio kept before speech start and after speech end (200 ms).
        max_turn_s: a turn is cut at this length (120 s; streaming ASR keeps its own
            buffer under Whisper's 30 s window, so turns may be longer).
        merge_window_ms: speech that resumes within this long after a turn ended
            continues that turn: its reply is cancelled and its transcript goes on from
            the words already committed (2000 ms), so a pause mid-thought gets one reply.
        barge_in_min_ms: speech over a reply must last this long and contain words
            (a partial transcript) to cancel the reply (400 ms).
        vad_gate: quiet windows after half a second of non-speech skip Silero, so a silent
            session costs almost nothing (:mod:`audio.vad_gate`; True; ``--no-vad-gate``).
    """

    threshold: float = 0.5
    neg_threshold: float = 0.35
    min_speech_ms: int = 250
    end_silence_ms: int = 500
    early_end_ms: int = 200
    pad_ms: int = 200
    max_turn_s: float = 120.0
    merge_window_ms: int = 2000
    barge_in_min_ms: int = 400
    vad_gate: bool = True


@dataclass(slots=True, kw_only=True)
class AsrConfig:
    """Whisper ASR: the shared engine and the per-session streaming policy.

    Attributes:
        model: ``tiny.en`` (package default), ``base`` (multilingual) or a local
            CTranslate2 Whisper folder.
        device: ``cpu`` or ``cuda``; ``auto`` picks CUDA when CTranslate2 sees one.
        compute_type: CTranslate2 compute type (``int8`` on CPU, ``float16`` on CUDA).
        threads: CPU threads for CTranslate2 (1: DESIGN.md §3 thread budget).
        beam_size: decoding beam (1 = greedy, fastest).
        no_speech_threshold: segments above this no-speech probability with a low
            log-probability are dropped (Whisper's 0.6).
        log_prob_threshold: average log-probability under which a segment is suspect (−1.0).
        compression_ratio_threshold: gzip ratio above which a segment is a repetition loop (2.4).
        queue_size: bounded request queue; a full queue answers ``busy``.
        max_batch_size: most decode requests (from any sessions) run together (8).
        max_wait_ms: how long a lone request waits for company (20 ms).
        encoder_batch: requests per encoder call; 0 = auto (1 on CPU, where batched
            encodes were slower per item; all of a group on CUDA).
        min_chunk_ms: a session's buffer is re-decoded after this much new audio (1000 ms).
        partial_batch_size: most partial updates decoded together (2): a final decode
            that arrives meanwhile waits for the batch in progress.
        partial_hold_max_ms: while other turns wait for their reply's first audio, a
            session's partial updates are put off, at most this long since its last
            one (6000 ms; see :mod:`pipeline.asr.turn`).
        partial_hold_overload_ms: ... while the server refuses turns (within the last
            ``AdmissionConfig.overload_s``): 30000 ms, in effect no live transcript (the
            final transcript still covers all the audio).
        pad_s: silence after the audio in the encoder window (3 s; less made Whisper loop).
        bucket_s: encoder windows are multiples of this (5 s), so requests of similar
            length share a batch.
        trim_s: once a session's buffer is longer than this, it is cut at a committed
            word (8 s); the committed text becomes the decoding prompt.
        max_buffer_s: a buffer never grows past this (20 s): words still not agreed on
            are committed and cut, so Whisper's 30 s window is never exceeded.
        prompt_tokens: tokens of earlier committed text used as the prompt (24).
    """

    model: str = "tiny.en"
    device: str = "auto"
    compute_type: str = "auto"
    threads: int = 1
    beam_size: int = 1
    no_speech_threshold: float = 0.6
    log_prob_threshold: float = -1.0
    compression_ratio_threshold: float = 2.4
    queue_size: int = 64
    max_batch_size: int = 8
    max_wait_ms: float = 20.0
    encoder_batch: int = 0
    min_chunk_ms: int = 1000
    partial_batch_size: int = 2
    partial_hold_max_ms: int = 6000
    partial_hold_overload_ms: int = 30000
    pad_s: float = 3.0
    bucket_s: float = 5.0
    trim_s: float = 8.0
    max_buffer_s: float = 20.0
    prompt_tokens: int = 24


@dataclass(slots=True, kw_only=True)
class LlmConfig:
    """Chat LLM.

    Attributes:
        model: ``qwen`` (default), ``smollm2`` or a local transformers folder.
        device: ``auto`` | ``cpu`` | ``cpu-fp32`` | ``cpu-int4`` | ``cpu-int8`` | ``cuda``
            (``pipeline.llm.loader.DEVICES``).
        threads: torch intra-op threads on CPU (1).
        burst_threads: torch threads for an LLM step while no other stage computes (ASR,
            TTS idle: :mod:`pipeline.cpu_share`); 0 or ≤ ``threads``: always ``threads``.
        max_new_tokens: tokens per reply (96: a couple of spoken sentences).
        max_context_tokens: history budget counted with the model's tokenizer (1024).
        system_prompt: default system prompt; a session may replace it.
        examples: example (user, assistant) exchanges put after the system prompt in every
            request (few-shot framing; they stay when a session replaces the system prompt).
            Without them the small default models often answer a statement by repeating it
            (issue 16's parrot rate on ``bench/prompts.tsv``, Qwen 0.5B greedy: 23 of 46
            replies parrot with this system prompt alone, 2 of 46 with these two examples;
            ``voxpipe bench replies``). () = none.
        queue_size: bounded request queue; a full queue answers ``busy``.
        memory_budget_mb: the LLM's memory budget in MiB — weights + KV cache + one
            step's activations (``--memory-budget``); 0 = auto: on CUDA the weights + 0.9 ×
            the free device memory, on CPU the weights + 0.5 × the available RAM, both
            measured after the weights loaded. The engine's KV token budget is
            ``min(max_kv_tokens, (budget − weights − activations) // KV bytes per token)``
            (:mod:`pipeline.llm.memory`), never under one full request.
        prefix_cache: reuse KV across requests by token blocks — a conversation's earlier
            turns are not prefilled again (:mod:`pipeline.llm.runner.block_cache`; True;
            ``--no-prefix-cache``). Cached blocks live within the KV budget.
        api_key: with ``model = "openai:URL[#model]"`` (a remote OpenAI-compatible server,
            :mod:`pipeline.llm.remote`): the Bearer token it wants (``--llm-api-key``; None:
            ``OPENAI_API_KEY``, else none sent that matters).
        tokenizer: remote only: a local Hugging Face tokenizer folder that counts the context
            budget exactly (``--tokenizer``); None: an estimate that errs high
            (:func:`pipeline.llm.counting.estimate_tokens`).
        remote_timeout_s: remote only: the longest silence of the server on a request, before
            its first chunk and between chunks (30 s; ``--llm-timeout-s``); then the reply
            fails with an error and the LLM breaker counts a failure.
    """

    model: str = "qwen"
    device: str = "auto"
    threads: int = 1
    burst_threads: int = 0
    max_new_tokens: int = 96
    max_context_tokens: int = 1024
    system_prompt: str = (
        "You are a helpful voice assistant talking with a person. "
        "Reply to what they say in one or two short spoken sentences."
    )
    examples: tuple[tuple[str, str], ...] = (
        ("I went to the market this morning.", "Nice! Did you find anything good?"),
        ("Why do cats purr?", "Mostly because they feel content, though some purr when they are stressed."),
    )
    queue_size: int = 64
    memory_budget_mb: float = 0.0
    prefix_cache: bool = True
    api_key: str | None = None
    tokenizer: str | None = None
    remote_timeout_s: float = 30.0


@dataclass(slots=True, kw_only=True)
class SchedulerConfig:
    """Batching knobs.

    Attributes:
        max_batch_size: most requests decoding together (8).
        max_wait_ms: how long a lone request waits for company before the batch starts
            (20 ms); requests arriving while a batch runs join at the next step anyway.
        max_prefill_tokens: prompt tokens prefilled in one step over all joining
            requests (512); longer prompts are prefilled in chunks over several steps,
            so a long or bursty prefill delays the running requests' next token by at
            most about one such chunk.
        max_prefill_tokens_decoding: the step's prefill budget while any request is
            decoding (256; 0 = ``max_prefill_tokens``). Every decoding reply's next token
            waits for the step's prefill, so while others stream, long prompts advance in
            smaller chunks: four 8000-character prompts no longer slow a fifth session's
            reply to a few tokens a second (Sarathi-Serve's stall-free batching, Agrawal
            et al., OSDI 2024). A voice turn's prompt (≤ 256 new tokens past the cached
            system prompt) still fits in one step.
        long_prompt_tokens, long_prefill_tokens, long_prefill_tokens_decoding: a prompt with
            more than ``long_prompt_tokens`` (256) left to prefill advances at most
            ``long_prefill_tokens_decoding`` (32) tokens per step while any other request
            decodes or prefills, and ``long_prefill_tokens`` (128) alone: one session's long
            prompt then costs the others' replies a few percent per token instead of a
            stall per chunk, and a turn that arrives meanwhile waits for one short step
            (vLLM's ``long_prefill_token_threshold`` idea; SRPT already lets short prompts
            pass it).
        max_prefill_attention: a chunk's tokens × the prompt tokens they attend to
            (512 × 1536): late chunks of a long prompt attend to everything before them,
            so they are cut shorter (at 6000 tokens in: ~120 tokens). A 512-token chunk
            6000 tokens into a prompt took 1.3-1.7 s with SmolLM2 on this CPU, stalling
            every running request for that long.
        max_kv_tokens: KV-cache budget in tokens over the batch, each request counted as
            prompt + max_new_tokens (16384); a request that would exceed it waits.
        static: static batching for comparison — start only with a full batch (or
            after ``max_wait_ms``) and admit nobody until the batch has drained.
        priority_age_ms: waiting requests take free slots by priority (voice turns before
            text API requests, :data:`~pipeline.llm.types.PRIORITY_TEXT`), then by arrival;
            one that has waited this long (2000 ms, the default voice SLO) competes as
            priority 0, so a stream of voice turns cannot starve text requests (aging, as
            in priority schedulers since Dijkstra's and Unix's).
    """

    max_batch_size: int = 8
    max_wait_ms: float = 20.0
    max_prefill_tokens: int = 512
    max_prefill_tokens_decoding: int = 256
    long_prompt_tokens: int = 256
    long_prefill_tokens: int = 128
    long_prefill_tokens_decoding: int = 32
    max_prefill_attention: int = 512 * 1536
    max_kv_tokens: int = 16384
    static: bool = False
    priority_age_ms: float = 2000.0


@dataclass(slots=True, kw_only=True)
class TtsConfig:
    """The TTS stage: Piper (default) or a Coqui TTS model folder (``--tts coqui:PATH``).

    Attributes:
        backend: ``piper`` (default) or ``coqui`` (:mod:`pipeline.tts.coqui`; the ``coqui`` extra).
        voice: piper: path to a Piper ``.onnx`` voice, or ``joe`` (package default); coqui: the
            model folder (``config.json`` + a checkpoint).
        threads: onnxruntime intra-op threads (piper), torch threads in the TTS worker (coqui) (1).
        workers: synthesizer threads sharing the voice (1).
        queue_size: bounded job queue.
        playback_lead_s: reply audio is sent at most this far ahead of real-time
            playback (1.0 s), so a barge-in silences the client quickly.
    """

    backend: str = "piper"
    voice: str = "joe"
    threads: int = 1
    workers: int = 1
    queue_size: int = 64
    playback_lead_s: float = 1.0


@dataclass(slots=True, kw_only=True)
class VoxpipeConfig:
    """The whole configuration."""

    turn: TurnConfig = field(default_factory=TurnConfig)
    asr: AsrConfig = field(default_factory=AsrConfig)
    llm: LlmConfig = field(default_factory=LlmConfig)
    llm_batch: SchedulerConfig = field(default_factory=SchedulerConfig)
    tts: TtsConfig = field(default_factory=TtsConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    degrade: DegradeConfig = field(default_factory=DegradeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def validate(self) -> VoxpipeConfig:
        """Cross-check fields; returns self.

        Raises:
            ValueError: a field is out of range.
        """
        t = self.turn
        if not 0.0 < t.neg_threshold < t.threshold < 1.0:
            raise ValueError("turn: need 0 < neg_threshold < threshold < 1")
        if t.end_silence_ms < 100 or t.min_speech_ms < 0 or t.pad_ms < 0:
            raise ValueError("turn: end_silence_ms >= 100, min_speech_ms >= 0, pad_ms >= 0")
        if not 0 <= t.early_end_ms < t.end_silence_ms:
            raise ValueError("turn: need 0 <= early_end_ms < end_silence_ms (0 turns speculation off)")
        if not 1.0 <= t.max_turn_s <= 3600.0:
            raise ValueError("turn: max_turn_s must be within 1..3600 s")
        a = self.asr
        if a.max_batch_size < 1 or a.max_wait_ms < 0 or a.encoder_batch < 0 or a.min_chunk_ms < 100:
            raise ValueError("asr: max_batch_size >= 1, max_wait_ms >= 0, encoder_batch >= 0, min_chunk_ms >= 100")
        if not (1.0 <= a.pad_s and 0.5 <= a.bucket_s and 2.0 <= a.trim_s < a.max_buffer_s
                and a.max_buffer_s + a.pad_s <= 30.0):
            raise ValueError("asr: need pad_s >= 1, bucket_s >= 0.5, 2 <= trim_s < max_buffer_s, "
                             "max_buffer_s + pad_s <= 30 (Whisper's window)")
        for name, n in (("asr.threads", self.asr.threads), ("llm.threads", self.llm.threads),
                        ("tts.threads", self.tts.threads), ("tts.workers", self.tts.workers)):
            if n < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.llm.burst_threads < 0:
            raise ValueError("llm.burst_threads must be >= 0 (0: off)")
        if self.tts.backend not in ("piper", "coqui"):
            raise ValueError(f"tts.backend {self.tts.backend!r}: piper or coqui")
        if self.llm.max_new_tokens < 1 or self.llm.max_context_tokens < 64:
            raise ValueError("llm: max_new_tokens >= 1 and max_context_tokens >= 64")
        if not self.llm.memory_budget_mb >= 0:  # also refuses NaN
            raise ValueError("llm.memory_budget_mb must be >= 0 (0: auto)")
        if not (math.isfinite(self.llm.remote_timeout_s) and 0 < self.llm.remote_timeout_s <= 3600):
            raise ValueError(f"llm.remote_timeout_s must be within (0, 3600] s, got {self.llm.remote_timeout_s!r}")
        b = self.llm_batch
        if b.max_batch_size < 1 or b.max_wait_ms < 0 or b.max_prefill_tokens < 16:
            raise ValueError("llm_batch: max_batch_size >= 1, max_wait_ms >= 0, max_prefill_tokens >= 16")
        if b.max_kv_tokens < self.llm.max_context_tokens + self.llm.max_new_tokens:
            raise ValueError("llm_batch.max_kv_tokens must fit at least one full request")
        if not 100.0 <= self.admission.slo_ms <= 600_000.0:
            raise ValueError("admission.slo_ms must be within 100..600000 ms")
        d = self.degrade
        from pipeline.serving.faults import parse_rules

        parse_rules(d.faults)  # raises ValueError for a bad rule
        for name in ("ladder_calm_s", "breaker_window_s", "breaker_open_s", "adapt_window_s", "adapt_down_s"):
            value = getattr(d, name)
            if not (math.isfinite(value) and 0 < value <= 86_400):
                raise ValueError(f"degrade.{name} must be a number of seconds in (0, 86400], got {value!r}")
        if not (math.isfinite(d.adapt_up_s) and 0 <= d.adapt_up_s <= 86_400) or not 0 < d.adapt_factor <= 1 \
                or not 0 < d.adapt_restore <= 1:
            raise ValueError("degrade: 0 <= adapt_up_s <= 86400, 0 < adapt_factor <= 1, 0 < adapt_restore <= 1")
        slow = d.breaker_slow_ms
        if set(slow) - {"asr", "llm", "tts"} or not all(math.isfinite(v) and v > 0 for v in slow.values()):
            raise ValueError("degrade.breaker_slow_ms: stages asr, llm, tts with finite times > 0 ms")
        if not (0 < d.breaker_slow_rate <= 1 and 0 < d.breaker_failure_rate <= 1) or d.breaker_min_calls < 1 \
                or d.breaker_probes < 1:
            raise ValueError("degrade: breaker rates in (0, 1], breaker_min_calls and breaker_probes >= 1")

        self.server.validate()
        return self


__all__ = ["AdmissionConfig", "AsrConfig", "DegradeConfig", "LlmConfig", "SchedulerConfig", "ServerConfig",
           "TtsConfig", "TurnConfig", "VoxpipeConfig", "is_loopback"]
