"""Typed configuration of serving under pressure: admission against the SLO, degradation
(the out-of-memory ladder, breakers, SLO adaptation, faults) and the server's edge.
Part of :class:`pipeline.config.VoxpipeConfig`, which re-exports these classes."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field


@dataclass(slots=True, kw_only=True)
class AdmissionConfig:
    """Admission control against a latency SLO (:mod:`pipeline.serving.admission`).

    Attributes:
        enabled: refuse turns predicted to miss the SLO (True).
        slo_ms: the voice-to-voice target: end of the user's speech (including the
            end-of-turn silence) to the reply's first audio (2000 ms, DESIGN.md §5).
        first_phrase_tokens: LLM tokens until a reply's first phrase is complete (8).
        prefill_steps: engine steps from joining the batch to the first token (2).
        prior_asr_ms, prior_llm_step_ms, prior_tts_ms, prior_reply_tokens: starting
            values of the measured service times (a final decode, an LLM step, a first
            phrase's synthesis, tokens per reply), replaced by measurements as turns
            complete (moving averages).
        prior_prefill_ms_per_token: starting value of the measured prefill time per prompt
            token (1.5 ms), learned from prompts over 256 tokens.
        base_prompt_tokens: prompt tokens past the cached system prompt that
            ``prefill_steps`` already covers (192); a longer prompt (a long typed question,
            a long conversation) adds its extra tokens × the prefill time per token.
        pending_ttl_s: an admitted turn counts as queued for the LLM until its request is
            submitted, or at most this long (10 s; a safety net, should a release be missed).
        correction_quantile: the prediction is scaled by this quantile of the recent
            actual ÷ predicted ratios (0.9: aim at the tail, not the mean).
        initial_limit, max_limit: the concurrency limit — admitted turns waiting for their
            first audio at once — starts at ``initial_limit`` (4) and adapts (AIMD, see
            :mod:`pipeline.serving.admission`) up to ``max_limit`` (64).
        limit_backoff: factor applied to the limit when an admitted turn's first audio comes
            later than ``headroom`` × ``slo_ms`` (0.75).
        headroom: a turn is refused when its corrected prediction exceeds this fraction of
            ``slo_ms`` (0.85): the prediction is an estimate, the SLO a promise.
        overload_s: the server counts as overloaded this long after it refused a turn
            (5 s): best-effort work (live partial transcripts) is shed meanwhile.
    """

    enabled: bool = True
    slo_ms: float = 2000.0
    first_phrase_tokens: int = 8
    prefill_steps: int = 2
    prior_asr_ms: float = 150.0
    prior_llm_step_ms: float = 50.0
    prior_tts_ms: float = 150.0
    prior_reply_tokens: float = 30.0
    prior_prefill_ms_per_token: float = 1.5
    base_prompt_tokens: int = 192
    pending_ttl_s: float = 10.0
    correction_quantile: float = 0.9
    initial_limit: float = 4.0
    max_limit: float = 64.0
    limit_backoff: float = 0.75
    overload_s: float = 5.0
    headroom: float = 0.85


@dataclass(slots=True, kw_only=True)
class DegradeConfig:
    """Degrade, don't die (DESIGN.md §5): the out-of-memory ladder, circuit breakers, SLO
    adaptation, the fallback model and fault injection (:mod:`pipeline.serving.governor`).

    Attributes:
        faults: fault-injection rules (``--fault``, ``VOXPIPE_FAULTS``; see
            :mod:`pipeline.serving.faults`); empty: none.
        fallback_llm: the smaller LLM for ladder step 3 and for degraded turns: a model name
            or folder; ``auto`` = ``smollm2`` when the main model is another one, else none;
            ``none`` disables it.
        preload_fallback: load the fallback model at start (default: on first need, in the
            background; until it is loaded, turns stay on the main model).
        ladder_calm_s: no OOM for this long steps a stage's ladder down one level (60 s).
        breaker_window_s: the breakers' time-based sliding window (10 s, resilience4j's
            ``slidingWindowSize`` in seconds).
        breaker_slow_ms: a stage call longer than this is slow, per stage, timed in the stage's
            thread: an ASR batch 3000 ms, an LLM model step 2000 ms, a TTS phrase 1500 ms. Set
            for a 2-core CPU and the 2 s SLO: a call this slow has spent most of a turn's
            budget, while a long prefill chunk, a long phrase or a batch of 20 s buffers on a
            busy CPU (about half of it) must not open a breaker.
        breaker_slow_rate, breaker_failure_rate: a breaker opens when this fraction of the
            window's calls were slow (0.5) or failed (0.3) ...
        breaker_min_calls: ... once the window holds at least this many calls (4).
        breaker_open_s: an open breaker rejects calls this long, then lets probes through (10 s).
        breaker_probes: calls permitted while half-open; their outcome closes or reopens it (3).
        short_reply_tokens: ``max_new_tokens`` of a reply while the LLM's breaker is open (24).
        stock_line: what is spoken when the LLM cannot answer (its breaker opened 3 times in a row).
        adapt: adapt to the SLO at run time (True).
        adapt_window_s: voice-to-voice samples of this last period count (60 s: one session's
            turns come every 5-10 s).
        adapt_min_samples: fewest samples to judge the p95 (5).
        adapt_up_s: least time between two steps up (5 s); adapt_down_s: the p95 must stay
            under ``adapt_restore`` × SLO (or no turns come) this long to step down (60 s: a
            shorter hold makes a machine that cannot keep the SLO at level 0 flap).
        adapt_restore: see adapt_down_s (0.8).
        adapt_factor: level 1 multiplies ``max_new_tokens`` and the history budget by this (0.5).
    """

    faults: tuple[str, ...] = ()
    fallback_llm: str = "auto"
    preload_fallback: bool = False
    ladder_calm_s: float = 60.0
    breaker_window_s: float = 10.0
    breaker_slow_ms: dict[str, float] = field(default_factory=lambda: {"asr": 3000.0, "llm": 2000.0, "tts": 1500.0})
    breaker_slow_rate: float = 0.5
    breaker_failure_rate: float = 0.3
    breaker_min_calls: int = 4
    breaker_open_s: float = 10.0
    breaker_probes: int = 3
    short_reply_tokens: int = 24
    stock_line: str = "Sorry, I can't answer that right now. Please try again in a moment."
    adapt: bool = True
    adapt_window_s: float = 60.0
    adapt_min_samples: int = 5
    adapt_up_s: float = 5.0
    adapt_down_s: float = 60.0
    adapt_restore: float = 0.8
    adapt_factor: float = 0.5


@dataclass(slots=True, kw_only=True)
class ServerConfig:
    """WebSocket server and its edge (who may connect, how fast a client may send).

    Attributes:
        host, port: listen address (127.0.0.1:8765). A host that is not loopback needs
            ``token``.
        max_message_bytes: largest WebSocket message accepted (4 MiB ≈ 65 s of 16 kHz
            f32 mono); a larger one closes the connection with code 1009.
        send_queue: outbound events buffered per session before the slowest data is
            dropped (256).
        slow_client_timeout_s: a client that does not read for this long is closed (10 s).
        max_sessions: open sessions at most; more connections are refused (HTTP 503 before
            the upgrade, or close code 1013) before they cost anything. 0 = auto: 8 per LLM
            batch slot (64 with the default batch of 8). The HTTP API (``/v1/...``) has a
            cap of its own of the same size on open connections (503 with ``Retry-After``).
        token: bearer token required on ``/ws`` (``Authorization: Bearer …`` or
            ``?token=…``), and on ``/metrics`` when the host is not loopback; None = none
            (allowed on loopback only).
        allow_origins: browser origins (``scheme://host[:port]``, or ``*``) allowed to open
            ``/ws`` besides the page's own origin; a request without ``Origin`` (not a
            browser) is not affected.
        allow_hosts: ``Host`` names accepted besides the loopback names (on a loopback
            server anything else is refused: DNS rebinding). On a non-loopback host the
            ``Host`` is checked only when this is given.
        idle_timeout_s: a session whose client sends no frame for this long is closed
            (300 s; 0 = never). WebSocket pings (every 20 s) close half-open connections.
        audio_rate_x: sustained audio input per client, × real time (3.0); beyond it and
            the burst, the server reads the client's audio at this rate (it stops reading
            the socket) and sends ``error`` ``rate_limited`` once.
        audio_burst_s: seconds of audio a client may send at once beyond the sustained
            rate (60 s: a file or clip sent as fast as possible).
        text_rate: sustained text frames per second per client (20; a frame counts once
            per started 16 KiB).
        text_burst: text frames a client may send at once (100).
        read_stall_s: longest one frame may stall its client's reader waiting for budget
            (3 s); audio beyond it in that frame, or a text frame that would wait longer,
            is dropped (``rate_limited`` says so). Keeps keepalive pongs flowing: at most
            ``receive_queue`` frames × this lie ahead of one, well under the 20 s timeout.
        receive_queue: frames websockets buffers per client before it stops reading the
            socket (4: with 4 MiB frames, 16 MiB per client at most).
        keepalive_s: ping interval and pong timeout (20 s); a connection with neither a pong
            nor a frame within twice the timeout is closed with 1011 (server/keepalive.py).
    """

    host: str = "127.0.0.1"
    port: int = 8765
    max_message_bytes: int = 4 * 1024 * 1024
    send_queue: int = 256
    slow_client_timeout_s: float = 10.0
    max_sessions: int = 0
    token: str | None = None
    allow_origins: tuple[str, ...] = ()
    allow_hosts: tuple[str, ...] = ()
    idle_timeout_s: float = 300.0
    audio_rate_x: float = 3.0
    audio_burst_s: float = 60.0
    text_rate: float = 20.0
    text_burst: float = 100.0
    read_stall_s: float = 3.0
    receive_queue: int = 4
    keepalive_s: float = 20.0

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
