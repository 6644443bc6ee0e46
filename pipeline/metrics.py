"""Prometheus metrics (prometheus_client), exported at ``/metrics``.

Latencies are histograms in seconds; the stages' loads (``stage.load()``) are read from the
engines when scraped.
"""

from __future__ import annotations

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pipeline import memory_parts

REGISTRY = CollectorRegistry()
_LAT = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)

ASR_SECONDS = Histogram("voxpipe_asr_seconds", "ASR decode time per utterance", buckets=_LAT, registry=REGISTRY)
ASR_RTF = Histogram("voxpipe_asr_rtf", "ASR real-time factor (decode time / audio time)",
                    buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0), registry=REGISTRY)
LLM_TTFT = Histogram("voxpipe_llm_ttft_seconds", "LLM time to first token", buckets=_LAT, registry=REGISTRY)
LLM_TPOT = Histogram("voxpipe_llm_tpot_seconds", "LLM time per output token",
                     buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5), registry=REGISTRY)
FIRST_AUDIO = Histogram("voxpipe_first_audio_seconds", "response start to first reply audio sent",
                        buckets=_LAT, registry=REGISTRY)
VOICE_TO_VOICE = Histogram("voxpipe_voice_to_voice_seconds", "end of user speech to first reply audio sent",
                           buckets=_LAT, registry=REGISTRY)
SPECULATIONS = Counter("voxpipe_speculations_total",
                       "speculative ends of turn (used: the turn ended there; dropped: the user went on; "
                       "failed: no transcript in time)", ["outcome"], registry=REGISTRY)
END_OF_TURN = Counter("voxpipe_end_of_turn_total",
                      "ends of speech turns by cause (silence: the silence rule; model: the end-of-turn model "
                      "said complete; cap: the eagerness's silence cap; fallback: the silence rule because the "
                      "model gave no answer; max_length; input_end)", ["cause"], registry=REGISTRY)
EOT_CHECKS = Counter("voxpipe_eot_checks_total",
                     "end-of-turn model checks by answer (complete, wait, none: busy or failed)", ["answer"],
                     registry=REGISTRY)
BARGE_INS = Counter("voxpipe_barge_ins_total",
                    "speech over a reply by outcome (cancelled: words cancelled it; continued: words continued "
                    "the turn it answered; new_turn: its final transcript started a new reply; resumed: it "
                    "paused the reply, which went on; ignored: no words or a backchannel, the reply played on)",
                    ["outcome"], registry=REGISTRY)
BACKCHANNELS_IGNORED = Counter("voxpipe_backchannels_ignored_total",
                               "speech over a reply that was only a backchannel (turn.empty backchannel)",
                               registry=REGISTRY)
ECHO_IGNORED = Counter("voxpipe_echo_ignored_total",
                       "speech over a reply that was the reply's own words coming back (turn.empty echo)",
                       registry=REGISTRY)
FALSE_INTERRUPTIONS = Counter("voxpipe_false_interruptions_resumed_total",
                              "replies paused by speech over them that resumed (no words, or a backchannel)",
                              registry=REGISTRY)
TOOL_CALLS = Counter("voxpipe_tool_calls_total",
                     "tool calls in voice and text turns by where they ran (server | client) and outcome "
                     "(ok | error: it raised, timed out or returned junk)", ["runs_on", "outcome"], registry=REGISTRY)
TOOL_SECONDS = Histogram("voxpipe_tool_call_seconds", "a tool call's duration (server tools; client tools: until "
                         "their tool.result)", buckets=_LAT, registry=REGISTRY)
TOOL_BOTCHED = Counter("voxpipe_tool_calls_botched_total",
                       "calls the model wrote wrong (not JSON, an unknown tool, arguments the schema rejects), by "
                       "fault; each is repaired once, then apologised for", ["fault"], registry=REGISTRY)
ADMISSIONS = Counter("voxpipe_admissions_total",
                     "turns admitted or refused at the end of the user's turn (reason: queue, memory, "
                     "sessions, stage; '' when admitted)", ["decision", "reason"], registry=REGISTRY)
PREDICTED = Histogram("voxpipe_admission_predicted_seconds",
                      "admission's predicted end of turn to first reply audio", buckets=_LAT, registry=REGISTRY)
LOOP_LAG = Histogram("voxpipe_event_loop_lag_seconds", "how late the server's event loop ran a due callback",
                     buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=REGISTRY)
SESSIONS = Gauge("voxpipe_sessions", "open sessions", registry=REGISTRY)
EDGE_REFUSALS = Counter("voxpipe_edge_refusals_total",
                        "HTTP requests refused before any upgrade, by reason (host, origin, token)", ["reason"],
                        registry=REGISTRY)
THROTTLED_SECONDS = Counter("voxpipe_client_throttled_seconds_total",
                            "time the server stopped reading clients that sent faster than their budget, by kind",
                            ["kind"], registry=REGISTRY)
AUDIO_DROPPED = Counter("voxpipe_client_audio_dropped_seconds_total",
                        "audio dropped from frames that held more than their client's budget allowed (s)",
                        registry=REGISTRY)
TEXT_DROPPED = Counter("voxpipe_client_text_dropped_frames_total",
                       "text frames dropped: their client was too far over its budget", registry=REGISTRY)
SESSIONS_CLOSED = Counter("voxpipe_sessions_closed_total",
                          "sessions ended, by reason (client, session_end, idle, keepalive, slow_client, internal, "
                          "not_ready, denied, server; over WebRTC also rtc_failed)",
                          ["reason"], registry=REGISTRY)
HTTP_API_REQUESTS = Counter("voxpipe_http_api_requests_total",
                            "OpenAI-compatible HTTP API requests (/v1/...), by endpoint and HTTP status",
                            ["endpoint", "status"], registry=REGISTRY)
ERRORS = Counter("voxpipe_client_errors_total", "error events sent to clients", ["code"], registry=REGISTRY)
LLM_RUNNING = Gauge("voxpipe_llm_running", "LLM requests decoding in the batch", registry=REGISTRY)
LLM_BATCH = Histogram("voxpipe_llm_batch_size", "requests per LLM decode step",
                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=REGISTRY)
QUEUE_DEPTH = Gauge("voxpipe_queue_depth", "requests waiting per stage", ["stage"], registry=REGISTRY)
RSS_BYTES = Gauge("voxpipe_process_rss_bytes", "resident memory of the server process", registry=REGISTRY)
MEMORY = Gauge("voxpipe_memory_bytes",
               "the server process's resident memory by part (pipeline/memory_parts.py): runtime (before "
               "any model loaded), weights_llm, "
               "weights_llm_fallback, weights_asr, weights_tts, weights_vad, weights_eot, kv_used, kv_reserved "
               "(allocated KV not holding tokens), prefix_cache, files (mapped files: libraries), rest (RSS minus the "
               "others, never below 0); the parts sum to voxpipe_process_rss_bytes", ["part"], registry=REGISTRY)
MALLOC_FREE = Gauge("voxpipe_malloc_free_bytes",
                    "freed memory glibc's malloc keeps for reuse, all arenas (mallinfo2 fordblks; 0 without glibc "
                    "2.33+): within the memory parts (mostly rest), at most what malloc_trim could return",
                    registry=REGISTRY)
LLM_MEMORY_BUDGET = Gauge("voxpipe_llm_memory_budget_bytes",
                          "the LLM's memory budget: weights + KV cache + one step's activations "
                          "(--memory-budget, or derived from free memory at load)", registry=REGISTRY)
LLM_KV_RESERVED = Gauge("voxpipe_llm_kv_reserved_bytes",
                        "KV-cache bytes the LLM batch's requests may hold: (prompt + max new tokens) "
                        "x KV bytes per token, summed", registry=REGISTRY)
LLM_KV_PER_TOKEN = Gauge("voxpipe_llm_kv_bytes_per_token",
                         "KV-cache bytes per token: 2 x layers x kv_heads x head_dim x bytes per element",
                         registry=REGISTRY)
PREFIX_QUERIED = Counter("voxpipe_llm_prefix_cache_queried_tokens_total",
                         "prompt tokens looked up in the LLM's prefix cache", registry=REGISTRY)
PREFIX_HIT = Counter("voxpipe_llm_prefix_cache_hit_tokens_total",
                     "prompt tokens found in the LLM's prefix cache (not prefilled again)", registry=REGISTRY)
PREFIX_EVICTED = Counter("voxpipe_llm_prefix_cache_evictions_total",
                         "cached KV blocks evicted (LRU under the KV budget, the OOM ladder, ended sessions)",
                         registry=REGISTRY)
PREFIX_TOKENS = Gauge("voxpipe_llm_prefix_cache_tokens", "tokens of KV in the LLM's prefix cache (16 per block)",
                      registry=REGISTRY)
LADDER_TRANSITIONS = Counter("voxpipe_oom_ladder_transitions_total",
                             "out-of-memory ladder transitions, by stage and the step entered (0-3)",
                             ["stage", "step"], registry=REGISTRY)
LADDER_STEP = Gauge("voxpipe_oom_ladder_step", "out-of-memory ladder step now, by stage (0: normal)", ["stage"],
                    registry=REGISTRY)
BREAKER_TRANSITIONS = Counter("voxpipe_breaker_transitions_total",
                              "circuit breaker transitions, by stage and the state entered", ["stage", "state"],
                              registry=REGISTRY)
BREAKER_STATE = Gauge("voxpipe_breaker_state", "circuit breaker state, by stage: 0 closed, 1 open, 2 half-open",
                      ["stage"], registry=REGISTRY)
SLO_TRANSITIONS = Counter("voxpipe_slo_adaptation_transitions_total",
                          "SLO adaptation level changes, by the level entered", ["level"], registry=REGISTRY)
SLO_LEVEL = Gauge("voxpipe_slo_adaptation_level",
                  "SLO adaptation level now: 0 normal, 1 shorter replies and history, 2 also the fallback model",
                  registry=REGISTRY)
EOT_SECONDS = Histogram("voxpipe_eot_batch_seconds",
                        "end-of-turn model time per batch (features and the ONNX run, every request in it)",
                        buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0), registry=REGISTRY)
EOT_BATCH = Histogram("voxpipe_eot_batch_size", "requests per end-of-turn model batch",
                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=REGISTRY)
EOT_REFUSED = Counter("voxpipe_eot_refused_total",
                      "end-of-turn requests refused: the model's queue was full (the turn falls back to silence)",
                      registry=REGISTRY)
DEGRADED_REPLIES = Counter("voxpipe_degraded_replies_total",
                           "replies made below normal service, by how: short, fallback_model, stock_line, text_only",
                           ["how"], registry=REGISTRY)


def render(engines=None) -> bytes:
    """Prometheus text exposition of every metric, refreshing gauges from ``engines``.

    The resident memory is read from ``/proc/self/statm`` (psutil) on the calling thread, the
    event loop's: 12-30 µs measured on a loaded 2-core machine, never disk I/O, less than a
    hop to a worker thread would cost. The memory parts are a few attribute reads, and
    ``voxpipe_malloc_free_bytes`` one walk of glibc's free lists (``mallinfo2``)."""
    mem = psutil.Process().memory_info()
    rss, files = mem.rss, getattr(mem, "shared", 0)  # current, not peak (ru_maxrss); shared: Linux only
    RSS_BYTES.set(rss)
    MALLOC_FREE.set(memory_parts.malloc_free())
    parts = memory_parts.split_rss(rss, {"files": files})
    if engines is not None:
        loads = engines.loads()
        for stage, load in loads.items():
            QUEUE_DEPTH.labels(stage).set(load.depth)
        LLM_RUNNING.set(loads["llm"].active)
        plan = getattr(engines.llm, "memory", None)  # the in-process engine's MemoryPlan; other stages skip these
        if plan is not None:
            LLM_KV_PER_TOKEN.set(plan.per_token)
            LLM_KV_RESERVED.set(plan.kv_bytes(loads["llm"].kv_reserved))
            LLM_MEMORY_BUDGET.set(plan.budget)
        prefix = getattr(engines.llm, "prefix", None)  # the in-process engine's prefix cache keeper
        if prefix is not None:
            PREFIX_TOKENS.set(prefix.stats[3])
        fallback = engines.fallback_llm.stage if engines.fallback_llm is not None else None
        parts = memory_parts.measure(rss, engines.weights, engines.llm, fallback, files=files)
    for part, n in parts.items():
        MEMORY.labels(part).set(n)
    return generate_latest(REGISTRY)
