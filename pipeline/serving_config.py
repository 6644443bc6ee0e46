"""Typed configuration of serving under pressure: admission against the SLO, degradation
(the out-of-memory ladder, breakers, SLO adaptation, faults) and the server's edge.
Part of :class:`pipeline.config.VoxpipeConfig`, which re-exports these classes; fields are
declared as there (:mod:`pipeline.config_fields`)."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from pipeline.config_fields import check_ranges, flag
from pipeline.fault_rules import ENV as FAULTS_ENV
from pipeline.fault_rules import parse_rules


@dataclass(slots=True, kw_only=True)
class AdmissionConfig:
    """Admission control against a latency SLO (:mod:`pipeline.serving.admission`)."""

    enabled: bool = flag(True, name="--no-admission")
    """Refuse turns predicted to miss the SLO with ``busy``."""
    slo_ms: float = flag(2000.0, name="--slo-ms")
    """The voice-to-voice latency target: end of the user's speech (including the end-of-turn
    silence) to the reply's first audio (ms)."""
    first_phrase_tokens: int = 8
    """LLM tokens until a reply's first phrase is complete."""
    prefill_steps: int = 2
    """Engine steps from joining the batch to the first token."""
    prior_asr_ms: float = 150.0
    """Starting value of the measured time of a final ASR decode (ms).

    This and the other ``prior_*`` values are replaced by measurements (moving averages) as
    turns complete."""
    prior_llm_step_ms: float = 50.0
    """Starting value of the measured time of an LLM step (ms)."""
    prior_tts_ms: float = 150.0
    """Starting value of the measured time of a first phrase's synthesis (ms)."""
    prior_reply_tokens: float = 30.0
    """Starting value of the measured tokens per reply."""
    prior_prefill_ms_per_token: float = 1.5
    """Starting value of the measured prefill time per prompt token (ms), learned from prompts
    over 256 tokens."""
    base_prompt_tokens: int = 192
    """Prompt tokens past the cached system prompt that ``prefill_steps`` already covers.

    A longer prompt (a long typed question, a long conversation) adds its extra tokens × the
    prefill time per token."""
    pending_ttl_s: float = 10.0
    """An admitted turn counts as queued for the LLM until its request is submitted, or at most
    this long (s; a safety net, should a release be missed)."""
    correction_quantile: float = 0.9
    """The prediction is scaled by this quantile of the recent actual ÷ predicted ratios (0.9:
    aim at the tail, not the mean)."""
    initial_limit: float = 4.0
    """The concurrency limit — admitted turns waiting for their first audio at once — starts
    here and adapts (AIMD, see :mod:`pipeline.serving.admission`)."""
    max_limit: float = 64.0
    """The concurrency limit adapts up to this."""
    limit_backoff: float = 0.75
    """Factor applied to the limit when an admitted turn's first audio comes later than
    ``headroom`` × ``slo_ms``."""
    overload_s: float = 5.0
    """The server counts as overloaded this long after it refused a turn (s): best-effort work
    (live partial transcripts) is shed meanwhile."""
    headroom: float = 0.85
    """A turn is refused when its corrected prediction exceeds this fraction of ``slo_ms``: the
    prediction is an estimate, the SLO a promise."""

    def validate(self) -> None:
        """Raises:
            ValueError: an SLO out of range."""
        if not 100.0 <= self.slo_ms <= 600_000.0:
            raise ValueError("admission.slo_ms must be within 100..600000 ms")
        check_ranges("admission", self, {
            "first_phrase_tokens": (1, 4096), "prefill_steps": (0, 1000), "prior_asr_ms": (0, 600_000),
            "prior_llm_step_ms": (0, 600_000), "prior_tts_ms": (0, 600_000), "prior_reply_tokens": (0, 1 << 20),
            "prior_prefill_ms_per_token": (0, 10_000), "base_prompt_tokens": (0, 1 << 24), "pending_ttl_s": (0, 3600),
            "correction_quantile": (0, 1), "max_limit": (1, 1 << 20), "initial_limit": (1, self.max_limit),
            "limit_backoff": (0, 1), "overload_s": (0, 86_400), "headroom": (0, 1)},
            above=frozenset({"pending_ttl_s", "limit_backoff", "headroom"}))


@dataclass(slots=True, kw_only=True)
class DegradeConfig:
    """Degrade, don't die: the out-of-memory ladder, circuit breakers, SLO adaptation, the
    fallback model and fault injection (:mod:`pipeline.serving.governor`)."""

    faults: tuple[str, ...] = flag((), name="--fault", metavar="RULE", env=FAULTS_ENV)
    """Fault-injection rules for tests and drills: STAGE:KIND[@FIRST][xCOUNT], e.g.
    ``llm:oom@1x2``, ``tts:slow:2000@1x*``, ``asr:error@1x*`` (SIGUSR1 stops them).

    See :mod:`pipeline.serving.faults`; empty: none."""
    fallback_llm: str = flag("auto", metavar="NAME")
    """The smaller LLM for degraded service (out-of-memory ladder step 3, SLO adaptation, the LLM
    breaker): a model name or folder; ``auto``: the next smaller packaged model
    (``qwen1.5b`` → ``qwen`` → ``smollm2``; ``pipeline.engines.FALLBACK_OF``); ``none``: off."""
    preload_fallback: bool = False
    """Load the fallback model at start (default: on first need, in the background; until it is
    loaded, turns stay on the main model)."""
    ladder_calm_s: float = 60.0
    """No out-of-memory error for this long steps a stage's ladder down one level (s)."""
    breaker_window_s: float = 10.0
    """The breakers' time-based sliding window (s; resilience4j's ``slidingWindowSize`` in
    seconds)."""
    breaker_slow_ms: dict[str, float] = flag(factory=lambda: {"asr": 3000.0, "llm": 2000.0, "tts": 1500.0},
                                             metavar="STAGE=MS")
    """A stage call longer than this is slow for its breaker, per stage (ms): an ASR batch, an
    LLM model step, a TTS phrase, timed in the stage's thread.

    Set for a 2-core CPU and the default SLO: a call this slow has spent most of a turn's
    budget, while a long prefill chunk, a long phrase or a batch of 20 s buffers on a busy CPU
    (about half of it) must not open a breaker."""
    breaker_slow_rate: float = 0.5
    """A breaker opens when this fraction of its window's calls were slow."""
    breaker_failure_rate: float = 0.3
    """A breaker opens when this fraction of its window's calls failed."""
    breaker_min_calls: int = 4
    """A breaker opens only once its window holds at least this many calls."""
    breaker_open_s: float = 10.0
    """An open breaker rejects calls this long, then lets probes through (s)."""
    breaker_probes: int = 3
    """Calls permitted while half-open; their outcome closes or reopens the breaker."""
    short_reply_tokens: int = 24
    """``max_new_tokens`` of a reply while the LLM's breaker is open."""
    stock_line: str = flag("Sorry, I can't answer that right now. Please try again in a moment.", metavar="TEXT")
    """What is spoken when the LLM cannot answer (its breaker opened 3 times in a row)."""
    adapt: bool = True
    """Adapt replies to the SLO at run time."""
    adapt_window_s: float = 60.0
    """SLO adaptation: voice-to-voice samples of this last period count (s; one session's turns
    come every 5-10 s)."""
    adapt_min_samples: int = 5
    """SLO adaptation: fewest samples to judge the p95."""
    adapt_up_s: float = 5.0
    """SLO adaptation: least time between two steps up (s)."""
    adapt_down_s: float = 60.0
    """SLO adaptation: the p95 must stay under ``adapt_restore`` × SLO (or no turns come) this
    long to step down (s).

    A shorter hold makes a machine that cannot keep the SLO at level 0 flap."""
    adapt_restore: float = 0.8
    """SLO adaptation: see ``adapt_down_s``."""
    adapt_factor: float = 0.5
    """SLO adaptation level 1 multiplies ``max_new_tokens`` and the history budget by this."""

    def validate(self) -> None:
        """Raises:
            ValueError: a bad fault rule, a duration, rate or count out of range, or a slow
                time for an unknown stage."""
        parse_rules(self.faults)  # raises ValueError for a bad rule
        for name in ("ladder_calm_s", "breaker_window_s", "breaker_open_s", "adapt_window_s", "adapt_down_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= 86_400):
                raise ValueError(f"degrade.{name} must be a number of seconds in (0, 86400], got {value!r}")
        if not (math.isfinite(self.adapt_up_s) and 0 <= self.adapt_up_s <= 86_400) \
                or not 0 < self.adapt_factor <= 1 or not 0 < self.adapt_restore <= 1:
            raise ValueError("degrade: 0 <= adapt_up_s <= 86400, 0 < adapt_factor <= 1, 0 < adapt_restore <= 1")
        slow = self.breaker_slow_ms
        if set(slow) - {"asr", "llm", "tts"} or not all(math.isfinite(v) and v > 0 for v in slow.values()):
            raise ValueError("degrade.breaker_slow_ms: stages asr, llm, tts with finite times > 0 ms")
        check_ranges("degrade", self, {"breaker_slow_rate": (0, 1), "breaker_failure_rate": (0, 1),
                                       "breaker_min_calls": (1, 1 << 20), "breaker_probes": (1, 1 << 20),
                                       "short_reply_tokens": (1, 1 << 20), "adapt_min_samples": (1, 1 << 20)},
                     above=frozenset({"breaker_slow_rate", "breaker_failure_rate"}))


@dataclass(slots=True, kw_only=True)
class ServerConfig:
    """The WebSocket server and its edge: who may connect, how fast a client may send."""

    host: str = "127.0.0.1"
    """Listen address; a host that is not loopback needs ``token``."""
    port: int = 8765
    """Listen port."""
    max_message_bytes: int = 4 * 1024 * 1024
    """Largest WebSocket message accepted (bytes; 4 MiB ≈ 65 s of 16 kHz f32 mono); a larger one
    closes the connection with code 1009."""
    send_queue: int = 256
    """Outbound frames (events and audio) buffered per session; when it is full the session's
    producers wait for the client to read (server/outbox.py)."""
    slow_client_timeout_s: float = 10.0
    """A client whose full send queue has not drained for this long is closed with 1008 (s)."""
    max_sessions: int = 0
    """Open sessions at most; more are refused (HTTP 503 / close 1013) before they cost anything
    (0: auto, 8 per LLM batch slot).

    503 before the upgrade, close code 1013 after it. The HTTP API (``/v1/...``) has a cap of
    its own of the same size on open connections (503 with ``Retry-After``)."""
    token: str | None = flag(None, env="VOXPIPE_TOKEN", metavar="TOKEN")
    """Bearer token clients must give on ``/ws``, and on ``/metrics`` off loopback; required when
    the host is not loopback.

    Given as ``Authorization: Bearer …`` or ``?token=…``; None: none (allowed on loopback
    only)."""
    allow_origins: tuple[str, ...] = flag((), name="--allow-origin", metavar="ORIGIN")
    """A browser origin (``scheme://host[:port]``, or ``*``) allowed to open ``/ws`` besides the
    page's own.

    A request without ``Origin`` (not a browser) is not affected."""
    allow_hosts: tuple[str, ...] = flag((), name="--allow-host", metavar="NAME")
    """A ``Host`` name accepted besides localhost/127.0.0.1/[::1] (e.g. behind a proxy).

    On a loopback server anything else is refused (DNS rebinding). On a non-loopback host the
    ``Host`` is checked only when this is given."""
    idle_timeout_s: float = 300.0
    """Close a session whose client sends no frame for this long (s; 0: never).

    WebSocket pings close half-open connections."""
    audio_rate_x: float = 3.0
    """Audio a client may send, × real time sustained, before the server reads it at this rate.

    Beyond it and the burst, the server stops reading the socket and sends ``error``
    ``rate_limited`` once."""
    audio_burst_s: float = 60.0
    """Seconds of audio a client may send at once beyond the sustained rate (a file or clip sent
    as fast as possible)."""
    text_rate: float = 20.0
    """Text frames per second a client may send sustained (a frame counts once, and once more
    per full 16 KiB)."""
    text_burst: float = 100.0
    """Text frames a client may send at once."""
    read_stall_s: float = 3.0
    """Longest one frame may stall its client's reader waiting for budget (s).

    Audio beyond it in that frame, or a text frame that would wait longer, is dropped
    (``rate_limited`` says so). Keeps keepalive pongs flowing: at most ``receive_queue`` frames
    × this lie ahead of one, well under the keepalive timeout."""
    receive_queue: int = 4
    """Frames websockets buffers per client before it stops reading the socket (with 4 MiB
    frames, 16 MiB per client at most)."""
    keepalive_s: float = 20.0
    """Ping interval and pong timeout (s); a connection with neither a pong nor a frame within
    twice the timeout is closed with 1011 (server/keepalive.py)."""

    def validate(self) -> None:
        """Raises:
            ValueError: a limit out of range, or a non-loopback host without a token."""
        if self.max_sessions < 0:
            raise ValueError("server.max_sessions must be >= 0 (0: auto)")
        if self.max_message_bytes < 4096:
            raise ValueError("server.max_message_bytes must be >= 4096")
        if not 1 <= self.receive_queue <= 64:
            raise ValueError("server.receive_queue must be within 1..64 frames")
        for name in ("audio_rate_x", "audio_burst_s", "text_rate", "text_burst", "read_stall_s", "keepalive_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"server.{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.idle_timeout_s) and self.idle_timeout_s >= 0):
            raise ValueError("server.idle_timeout_s must be >= 0 s (0: never)")
        check_ranges("server", self, {
            "port": (0, 65_535), "max_message_bytes": (4096, 1 << 30), "send_queue": (1, 1 << 20),
            "slow_client_timeout_s": (0, 86_400), "max_sessions": (0, 1 << 20), "idle_timeout_s": (0, 86_400 * 365)},
            above=frozenset({"slow_client_timeout_s"}))
        if self.token is not None and not self.token.strip():
            raise ValueError("server.token is empty: give a secret, or none on a loopback host")
        if not self.token and not is_loopback(self.host):
            raise ValueError(f"listening on {self.host}, which is not loopback, needs a token: set --token or "
                             "VOXPIPE_TOKEN (anyone who reaches the port could use the server and its models)")


def is_loopback(host: str) -> bool:
    """``host`` (a name or address, IPv6 with or without brackets) is a loopback one:
    ``localhost`` or in 127.0.0.0/8 or ::1. ``0.0.0.0``/``::`` (every interface) are not."""
    host = host.strip().lower().removeprefix("[").removesuffix("]")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
