"""Typed configuration: one :class:`VoxpipeConfig` composed of per-stage sections.

Each field is declared once — type, default, and its help in the docstring right under it —
and ``voxpipe serve``'s flags are generated from these declarations (:mod:`cli.flags`; flag
names and placeholders in :func:`~pipeline.config_fields.flag` metadata). Each section checks
its own fields (``validate``); :meth:`VoxpipeConfig.validate` runs them all, then the checks
that span sections. The serving sections (admission, degradation, the server's edge) live in
:mod:`pipeline.serving_config`, turn-taking in :mod:`pipeline.turn_config`, tools in
:mod:`pipeline.tools_config`; this module exports every section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from pipeline.config_fields import check_ranges, flag, section
from pipeline.serving_config import AdmissionConfig, DegradeConfig, ServerConfig, is_loopback
from pipeline.tools_config import ToolsConfig
from pipeline.turn_config import EAGERNESS, END_OF_TURN, TurnConfig


@dataclass(slots=True, kw_only=True)
class AsrConfig:
    """Whisper ASR: the shared engine and the per-session streaming policy."""

    model: str = flag("tiny.en", metavar="NAME")
    """Whisper model: ``tiny.en``, ``base`` (multilingual, detects the language) or a local
    CTranslate2 Whisper folder."""
    device: str = "auto"
    """``cpu`` or ``cuda``; ``auto`` picks CUDA when CTranslate2 sees one."""
    compute_type: str = "auto"
    """CTranslate2 compute type; ``auto``: ``int8`` on CPU, ``float16`` on CUDA."""
    threads: int = 1
    """CPU threads for CTranslate2."""
    beam_size: int = 1
    """Decoding beam (1: greedy, fastest)."""
    no_speech_threshold: float = 0.6
    """Segments above this no-speech probability with a low log-probability are dropped
    (Whisper's value)."""
    log_prob_threshold: float = -1.0
    """Average log-probability under which a segment is suspect."""
    compression_ratio_threshold: float = 2.4
    """Gzip ratio above which a segment is a repetition loop."""
    queue_size: int = 64
    """Bounded request queue; a full queue answers ``busy``."""
    max_batch_size: int = flag(8, name="--asr-batch-size")
    """Most decode requests (from any sessions) run together."""
    max_wait_ms: float = 20.0
    """How long a lone decode request waits for company (ms)."""
    encoder_batch: int = 0
    """Requests per encoder call; 0: auto (1 on CPU, where batched encodes were slower per
    item; all of a group on CUDA)."""
    min_chunk_ms: int = 1000
    """A session's buffer is re-decoded after this much new audio (ms)."""
    partial_batch_size: int = 2
    """Most partial updates decoded together.

    A final decode that arrives meanwhile waits for the batch in progress."""
    partial_hold_max_ms: int = 6000
    """While other turns wait for their reply's first audio, a session's partial updates are
    put off, at most this long since its last one (ms; see :mod:`pipeline.asr.turn`)."""
    partial_hold_overload_ms: int = 30000
    """The same hold while the server refuses turns, within the last
    ``AdmissionConfig.overload_s`` (ms).

    The default means in effect no live transcript (the final transcript still covers all the
    audio)."""
    pad_s: float = 3.0
    """Silence after the audio in the encoder window (s; less made Whisper loop)."""
    bucket_s: float = 5.0
    """Encoder windows are multiples of this (s), so requests of similar length share a batch."""
    short_final_window_s: float = 15.0
    """Encoder window of a final decode whose audio fits the smallest window (s; one word).

    Whisper drops or repeats a lone word in a 5 s window (see :mod:`pipeline.asr.decode`)."""
    trim_s: float = 8.0
    """Once a session's buffer is longer than this, it is cut at a committed word (s).

    The committed text becomes the decoding prompt."""
    max_buffer_s: float = 20.0
    """A buffer never grows past this (s).

    Words still not agreed on are committed and cut, so Whisper's 30 s window is never
    exceeded."""
    prompt_tokens: int = 24
    """Tokens of earlier committed text used as the prompt."""

    def validate(self) -> None:
        """Raises:
            ValueError: a batching knob or window out of range, or no thread."""
        if self.max_batch_size < 1 or self.max_wait_ms < 0 or self.encoder_batch < 0 or self.min_chunk_ms < 100:
            raise ValueError("asr: max_batch_size >= 1, max_wait_ms >= 0, encoder_batch >= 0, min_chunk_ms >= 100")
        if not (1.0 <= self.pad_s and 0.5 <= self.bucket_s and 2.0 <= self.trim_s < self.max_buffer_s
                and self.max_buffer_s + self.pad_s <= 30.0):
            raise ValueError("asr: need pad_s >= 1, bucket_s >= 0.5, 2 <= trim_s < max_buffer_s, "
                             "max_buffer_s + pad_s <= 30 (Whisper's window)")
        if self.threads < 1:
            raise ValueError("asr.threads must be >= 1")
        check_ranges("asr", self, {
            "threads": (1, 1024), "beam_size": (1, 64), "no_speech_threshold": (0, 1), "log_prob_threshold": (-100, 0),
            "compression_ratio_threshold": (1, 100), "queue_size": (1, 1 << 20), "max_batch_size": (1, 4096),
            "max_wait_ms": (0, 60_000), "encoder_batch": (0, 4096), "min_chunk_ms": (100, 30_000),
            "partial_batch_size": (1, 4096), "partial_hold_max_ms": (0, 600_000),
            "partial_hold_overload_ms": (0, 600_000), "prompt_tokens": (0, 223), "pad_s": (1, 30),
            "bucket_s": (0.5, 30), "short_final_window_s": (0.5, 30), "trim_s": (2, 30), "max_buffer_s": (2, 30)})


@dataclass(slots=True, kw_only=True)
class LlmConfig:
    """The chat LLM."""

    model: str = flag("qwen1.5b", name="--llm", metavar="NAME")
    """``qwen1.5b`` (Qwen2.5-Coder-1.5B-Instruct, the default: the best replies within the latency
    budget, ``voxpipe bench quality`` and ``bench voice``, docs/BENCHMARKS.md issue 33), ``qwen``
    (the 0.5B: faster, the fallback), ``smollm2``, a local transformers folder, or
    ``openai:URL[#MODEL]``: a running OpenAI-compatible server, e.g.
    ``openai:http://127.0.0.1:8000/v1`` (:mod:`pipeline.llm.remote`)."""
    device: str = flag("auto", name="--device")
    """``auto`` (cuda if present, else cpu-int4 on a CPU with native bf16, else cpu-fp32), ``cpu``
    (bf16), ``cpu-fp32``, ``cpu-int4``, ``cpu-int8`` (weight-only quantized linears, bf16
    activations) or ``cuda`` (``pipeline.llm.loader.DEVICES``)."""
    threads: int = 1
    """Torch intra-op threads on CPU."""
    burst_threads: int | None = flag(None, metavar="N")
    """Torch threads for an LLM step while no other stage computes (none given: the CPUs this
    process may use, at most 4; 0 or ≤ ``threads``: always ``threads``).

    ASR and TTS idle: :mod:`pipeline.cpu_share`. None (auto) is resolved where the engines
    load: a server that runs every stage in one process
    (:func:`pipeline.engines.load_engines`) takes
    :func:`pipeline.cpu_share.auto_burst_threads`; an engine built otherwise (a Ray Serve
    replica, which has no ASR or TTS beside it to yield to; a benchmark) does not burst."""
    max_new_tokens: int = flag(96, name="--max-new-tokens")
    """Tokens per reply at most (a couple of spoken sentences)."""
    max_context_tokens: int = 1024
    """History budget in tokens, counted with the model's tokenizer."""
    system_prompt: str = flag(
        "You are a helpful voice assistant talking with a person. "
        "Reply to what they say in one or two short spoken sentences.", metavar="TEXT")
    """Default system prompt; a session may replace it."""
    examples: tuple[tuple[str, str], ...] = flag((
        ("I went to the market this morning.", "Nice! Did you find anything good?"),
        ("Why do cats purr?", "Mostly because they feel content, though some purr when they are stressed."),
    ), metavar="JSON")
    """Example (user, assistant) exchanges put after the system prompt in every request: a JSON
    list of pairs (``[]``: none).

    Few-shot framing; they stay when a session replaces the system prompt. Without them the
    small default models often answer a statement by repeating it (issue 16's parrot rate on
    ``bench/prompts.tsv``, Qwen 0.5B greedy: 23 of 46 replies parrot with this system prompt
    alone, 2 of 46 with these two examples; ``voxpipe bench replies``)."""
    queue_size: int = 64
    """Bounded request queue; a full queue answers ``busy``."""
    memory_budget_mb: float = flag(0.0, name="--memory-budget", metavar="MB")
    """The LLM's memory budget in MiB — weights + KV cache + one step's activations — which caps
    the KV token budget (0: auto: on CUDA the weights + 0.9 × the free device memory, on CPU
    the weights + 0.5 × the available RAM).

    Both auto figures are measured after the weights loaded. The engine's KV token budget is
    ``min(max_kv_tokens, (budget − weights − activations) // KV bytes per token)``
    (:mod:`pipeline.llm.memory`), never under one full request."""
    prefix_cache: bool = flag(True, name="--no-prefix-cache")
    """Reuse KV across requests by token blocks: a conversation's earlier turns are not
    prefilled again (:mod:`pipeline.llm.runner.block_cache`).

    Cached blocks live within the KV budget."""
    api_key: str | None = flag(None, metavar="KEY")
    """With ``--llm openai:URL``: the Bearer token its server wants (none given:
    ``OPENAI_API_KEY``, else none sent that matters)."""
    tokenizer: str | None = flag(None, name="--tokenizer", metavar="PATH")
    """With ``--llm openai:URL``: a local Hugging Face tokenizer folder that counts the context
    budget exactly (none given: an estimate that errs high,
    :func:`pipeline.llm.counting.estimate_tokens`)."""
    remote_timeout_s: float = flag(30.0, name="--llm-timeout-s")
    """With ``--llm openai:URL``: the longest silence of its server on a request, before the
    first chunk and between chunks (s).

    Then the reply fails with an error and the LLM breaker counts a failure."""

    def validate(self) -> None:
        """Raises:
            ValueError: no thread, a negative burst, a token budget, memory budget or remote
                timeout out of range, or an example that is not a pair of strings."""
        if self.threads < 1:
            raise ValueError("llm.threads must be >= 1")
        if self.burst_threads is not None and self.burst_threads < 0:
            raise ValueError("llm.burst_threads must be >= 0 (0: off)")
        if self.max_new_tokens < 1 or self.max_context_tokens < 64:
            raise ValueError("llm: max_new_tokens >= 1 and max_context_tokens >= 64")
        if not self.memory_budget_mb >= 0:  # also refuses NaN
            raise ValueError("llm.memory_budget_mb must be >= 0 (0: auto)")
        if not (math.isfinite(self.remote_timeout_s) and 0 < self.remote_timeout_s <= 3600):
            raise ValueError(f"llm.remote_timeout_s must be within (0, 3600] s, got {self.remote_timeout_s!r}")
        if not all(isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(text, str) for text in pair)
                   for pair in self.examples):
            raise ValueError("llm.examples must be (user, assistant) pairs of strings")
        check_ranges("llm", self, {"threads": (1, 1024), "burst_threads": (0, 1024), "max_new_tokens": (1, 1 << 20),
                                   "max_context_tokens": (64, 1 << 24), "queue_size": (1, 1 << 20),
                                   "memory_budget_mb": (0, 1 << 30)})


@dataclass(slots=True, kw_only=True)
class SchedulerConfig:
    """LLM batching knobs."""

    max_batch_size: int = 8
    """Most LLM requests decoding together."""
    max_wait_ms: float = 20.0
    """How long a lone LLM request waits for company before the batch starts (ms); requests
    arriving while a batch runs join at the next step anyway."""
    max_prefill_tokens: int = 512
    """Prompt tokens prefilled in one step over all joining requests.

    Longer prompts are prefilled in chunks over several steps, so a long or bursty prefill
    delays the running requests' next token by at most about one such chunk."""
    max_prefill_tokens_decoding: int = 256
    """The step's prefill budget while any request is decoding (0: ``max_prefill_tokens``).

    Every decoding reply's next token waits for the step's prefill, so while others stream,
    long prompts advance in smaller chunks: four 8000-character prompts no longer slow a fifth
    session's reply to a few tokens a second (Sarathi-Serve's stall-free batching, Agrawal et
    al., OSDI 2024). A voice turn's prompt (≤ 256 new tokens past the cached system prompt)
    still fits in one step."""
    long_prompt_tokens: int = 256
    """A prompt with more than this many tokens left to prefill is long: it advances in the
    small steps below.

    One session's long prompt then costs the others' replies a few percent per token instead
    of a stall per chunk, and a turn that arrives meanwhile waits for one short step (vLLM's
    ``long_prefill_token_threshold`` idea; SRPT already lets short prompts pass it)."""
    long_prefill_tokens: int = 128
    """Tokens a long prompt advances per step while it is alone."""
    long_prefill_tokens_decoding: int = 32
    """Tokens a long prompt advances per step while any other request decodes or prefills."""
    max_prefill_attention: int = 512 * 1536
    """A chunk's tokens × the prompt tokens they attend to.

    Late chunks of a long prompt attend to everything before them, so they are cut shorter (at
    6000 tokens in: about 120 tokens); a full 512-token chunk that deep stalls every running
    request for as long as it takes."""
    max_kv_tokens: int = 16384
    """KV-cache budget in tokens over the batch, each request counted as prompt +
    ``max_new_tokens``; a request that would exceed it waits."""
    static: bool = flag(False, name="--static-batching")
    """Static batching for comparison: start only with a full batch (or after
    ``max_wait_ms``) and admit nobody until the batch has drained."""
    priority_age_ms: float = 2000.0
    """A waiting request that has waited this long competes as priority 0 (ms).

    Waiting requests take free slots by priority (voice turns before text API requests,
    :data:`~pipeline.llm.types.PRIORITY_TEXT`), then by arrival; aging (as in priority
    schedulers since Dijkstra's and Unix's) keeps a stream of voice turns from starving text
    requests. The default is the default voice SLO."""

    def validate(self) -> None:
        """Raises:
            ValueError: no batch slot, a negative wait, or a prefill budget under 16 tokens."""
        if self.max_batch_size < 1 or self.max_wait_ms < 0 or self.max_prefill_tokens < 16:
            raise ValueError("llm_batch: max_batch_size >= 1, max_wait_ms >= 0, max_prefill_tokens >= 16")
        check_ranges("llm_batch", self, {
            "max_batch_size": (1, 4096), "max_wait_ms": (0, 60_000), "max_prefill_tokens": (16, 1 << 24),
            "max_prefill_tokens_decoding": (0, 1 << 24), "long_prompt_tokens": (1, 1 << 24),
            "long_prefill_tokens": (1, 1 << 24), "long_prefill_tokens_decoding": (1, 1 << 24),
            "max_prefill_attention": (1, 1 << 40), "max_kv_tokens": (1, 1 << 30), "priority_age_ms": (0, 86_400_000)})


@dataclass(slots=True, kw_only=True)
class TtsConfig:
    """The TTS stage: Piper (default) or a Coqui TTS model folder."""

    backend: str = flag("piper", name="--tts", metavar="piper|piper:VOICE|coqui:PATH")
    """``piper`` (the ``--voice`` voices), ``piper:VOICE`` (one voice: joe or a Piper .onnx), or
    ``coqui:PATH`` (a Coqui TTS model folder: config.json + checkpoint; VITS, its speakers and
    languages the voices; needs the coqui extra).

    :mod:`pipeline.tts.coqui` runs Coqui. A value with a colon is split into ``backend`` and
    ``voices`` at start-up (:func:`pipeline.tts.choice.resolve_tts`)."""
    voices: tuple[str, ...] = flag((), name="--voice", metavar="[LANG=]VOICE")
    """A voice for a language: ``LANG=VOICE``, ``VOICE`` (English) — ``joe``, ``espeak:CODE``
    (an espeak-ng voice) or a Piper ``.onnx`` path; the first is the default voice, none: joe.

    Each voice is loaded once and shared by every session; a reply is spoken by the voice of
    its turn's language unless the session chose one (:mod:`pipeline.tts.catalogue`). Coqui:
    the model folder (``config.json`` + a checkpoint); its speakers are the voices
    (:func:`pipeline.tts.coqui.model_voices`)."""
    threads: int = 1
    """Onnxruntime intra-op threads (Piper), torch threads in the TTS worker (Coqui)."""
    workers: int = 1
    """Synthesizer threads sharing the voice."""
    queue_size: int = 64
    """Bounded job queue; a full queue answers ``busy``."""
    bounded_arena: bool = flag(True, name="--tts-unbounded-arena")
    """Piper: no memory pattern per input shape, and onnxruntime's CPU arena shrunk whenever the
    TTS stage goes idle (:mod:`pipeline.tts.arena`), so a long run does not grow;
    ``--tts-unbounded-arena`` keeps onnxruntime's defaults."""
    playback_lead_s: float = 1.0
    """Reply audio is sent at most this far ahead of real-time playback (s), so a barge-in
    silences the client quickly."""

    @property
    def voice(self) -> str:
        """The default (first) voice's ``VOICE`` part (``joe`` without any ``--voice``): a Piper
        voice, an ``espeak:CODE`` or a Coqui folder."""
        if not self.voices:
            return "joe"
        item = self.voices[0]
        lang, sep, voice = item.partition("=")
        return voice.strip() if sep and "/" not in lang else item.strip()

    def validate(self) -> None:
        """Raises:
            ValueError: no thread or worker, or an unknown backend."""
        for name, n in (("tts.threads", self.threads), ("tts.workers", self.workers)):
            if n < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.backend not in ("piper", "coqui"):
            raise ValueError(f"tts.backend {self.backend!r}: piper or coqui")
        check_ranges("tts", self, {"threads": (1, 1024), "workers": (1, 1024), "queue_size": (1, 1 << 20),
                                   "playback_lead_s": (0, 60)}, above=frozenset({"playback_lead_s"}))


@dataclass(slots=True, kw_only=True)
class VoxpipeConfig:
    """The whole configuration: one section per stage and serving concern; each section's
    fields become ``voxpipe serve`` flags that start with its prefix."""

    turn: TurnConfig = section(TurnConfig, prefix="")
    asr: AsrConfig = section(AsrConfig, prefix="asr-")
    llm: LlmConfig = section(LlmConfig, prefix="llm-")
    llm_batch: SchedulerConfig = section(SchedulerConfig, prefix="")
    tts: TtsConfig = section(TtsConfig, prefix="tts-")
    admission: AdmissionConfig = section(AdmissionConfig, prefix="admission-")
    degrade: DegradeConfig = section(DegradeConfig, prefix="")
    server: ServerConfig = section(ServerConfig, prefix="")
    tools: ToolsConfig = section(ToolsConfig, prefix="tool-")

    def validate(self) -> VoxpipeConfig:
        """Check every section, then what spans sections; returns self.

        Raises:
            ValueError: a field is out of range.
        """
        for f in fields(self):
            getattr(self, f.name).validate()
        if self.llm_batch.max_kv_tokens < self.llm.max_context_tokens + self.llm.max_new_tokens:
            raise ValueError("llm_batch.max_kv_tokens must fit at least one full request")
        return self


__all__ = ["EAGERNESS", "END_OF_TURN", "AdmissionConfig", "AsrConfig", "DegradeConfig", "LlmConfig", "SchedulerConfig",
           "ServerConfig", "ToolsConfig", "TtsConfig", "TurnConfig", "VoxpipeConfig", "is_loopback"]
