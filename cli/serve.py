"""``voxpipe serve``: flags → :class:`~pipeline.config.VoxpipeConfig`, models, the server."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path


def runtime_env() -> None:
    """Thread and memory settings for the model runtimes, before any model loads (a user's
    own environment wins): idle OpenMP threads sleep instead of spinning (2-core budget),
    after a spin of :data:`pipeline.cpu_share.OMP_SPIN_COUNT` between a step's kernels; and oneDNN keeps at
    most 256 compiled kernels — one per linear-layer shape and token count (the LLM runner
    rounds step lengths up to multiples of 8, so its working set fits); the default 1024
    grew RSS by ~230 MB as steps of new lengths came (SmolLM2)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from pipeline.cpu_share import OMP_SPIN_COUNT

    os.environ.setdefault("GOMP_SPINCOUNT", str(OMP_SPIN_COUNT))
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")


def serve_command(args) -> int:
    """``voxpipe serve``: build the configuration from the flags (exit 2 on a bad one), load the
    models (or deploy them on Ray Serve) and serve until SIGINT/SIGTERM."""
    runtime_env()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a drill's "stop faults" must never kill a server still starting
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pipeline.config import (
        AdmissionConfig,
        AsrConfig,
        DegradeConfig,
        LlmConfig,
        SchedulerConfig,
        ServerConfig,
        TtsConfig,
        TurnConfig,
        VoxpipeConfig,
    )
    from pipeline.tts.choice import tts_config

    cfg = VoxpipeConfig(
        turn=TurnConfig(end_silence_ms=args.end_silence_ms, early_end_ms=args.early_end_ms,
                        vad_gate=not args.no_vad_gate),
        asr=AsrConfig(model=args.asr_model, max_batch_size=args.asr_batch_size),
        llm=LlmConfig(model=args.llm, device=args.device, threads=args.llm_threads,
                      burst_threads=_burst_threads(args),
                      max_new_tokens=args.max_new_tokens,
                      memory_budget_mb=args.memory_budget,
                      prefix_cache=not args.no_prefix_cache, api_key=args.llm_api_key, tokenizer=args.tokenizer,
                      remote_timeout_s=args.llm_timeout_s),
        llm_batch=SchedulerConfig(max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms),
        tts=TtsConfig(voice=args.voice, threads=args.tts_threads),
        admission=AdmissionConfig(enabled=not args.no_admission, slo_ms=args.slo_ms),
        server=ServerConfig(host=args.host, port=args.port, max_sessions=args.max_sessions, token=args.token,
                            allow_origins=tuple(args.allow_origin), allow_hosts=tuple(args.allow_host),
                            idle_timeout_s=args.idle_timeout_s, audio_rate_x=args.audio_rate_x,
                            audio_burst_s=args.audio_burst_s, text_rate=args.text_rate),
    )
    try:
        cfg.degrade = _degrade_config(args, DegradeConfig)
        cfg.tts = tts_config(args.tts, voice=args.voice, threads=args.tts_threads)
        _check_llm(args)
        cfg.validate()
    except ValueError as exc:
        print(f"voxpipe: bad configuration: {exc}", file=sys.stderr)
        return 2
    try:
        ray_opts = ray_options(args)
    except ValueError as exc:
        print(f"voxpipe: bad configuration: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve_async(cfg, ray_opts))


def _burst_threads(args) -> int:
    """``--llm-burst-threads``, or its default: :func:`~pipeline.cpu_share.auto_burst_threads`
    in one process; 0 with ``--ray`` (a stage replica's process has no ASR/TTS beside it to
    yield to, and Ray gives it its CPUs)."""
    from pipeline.cpu_share import auto_burst_threads

    if args.llm_burst_threads is not None:
        return args.llm_burst_threads
    return 0 if args.ray is not None else auto_burst_threads()


def _check_llm(args) -> None:
    """Validate ``--llm`` (a name, a local folder or ``openai:URL[#MODEL]``) and the flags
    that only go with a remote one.

    Raises:
        ValueError: an unknown name or ``--device``, a bad URL, or
            ``--tokenizer``/``--llm-api-key`` without a remote LLM.
    """
    from pipeline.llm.loader import LLM_CHOICES, check_device
    from pipeline.llm.types import RemoteLlmSpec

    check_device(args.device)
    if not RemoteLlmSpec.is_remote(args.llm):
        if args.llm not in LLM_CHOICES and not Path(args.llm).is_dir():
            raise ValueError(f"--llm {args.llm!r}: use one of {', '.join(LLM_CHOICES)}, a local transformers folder "
                             "or openai:URL[#MODEL]")
        if args.tokenizer or args.llm_api_key:
            raise ValueError("--tokenizer and --llm-api-key go with --llm openai:URL (a local model counts with "
                             "its own tokenizer)")
        return
    RemoteLlmSpec.parse(args.llm)
    if args.ray is not None:
        raise ValueError("--llm openai:URL does not run in Ray Serve deployments: drop --ray")
    if args.tokenizer and not Path(args.tokenizer).is_dir():
        raise ValueError(f"--tokenizer {args.tokenizer}: not a folder (give a local Hugging Face tokenizer folder)")


def ray_options(args) -> dict | None:
    """``connect_engines`` keywords from the ``--ray*`` flags; None without ``--ray``.

    Raises:
        ValueError: a ``--ray-replicas`` that is not STAGE=N, or ``--ray-*`` without ``--ray``.
    """
    if args.ray is None:
        if args.ray_config or args.ray_replicas or args.ray_existing or args.ray_cpus is not None:
            raise ValueError("--ray-config, --ray-replicas, --ray-existing and --ray-cpus need --ray")
        return None
    replicas: dict[str, int] = {}
    for item in args.ray_replicas:
        stage, _, n = item.partition("=")
        if stage.strip() not in ("asr", "llm", "tts") or not n.strip().isdigit() or int(n) < 1:
            raise ValueError(f"--ray-replicas {item!r}: expected STAGE=N with STAGE asr, llm or tts and N >= 1")
        replicas[stage.strip()] = int(n)
    return {"address": args.ray, "config_path": args.ray_config, "replicas": replicas,
            "existing": args.ray_existing, "num_cpus": args.ray_cpus}


def _degrade_config(args, cls):
    """``DegradeConfig`` from the flags and ``VOXPIPE_FAULTS``.

    Raises:
        ValueError: a ``--breaker-slow-ms`` that is not STAGE=MS.
    """
    slow = dict(cls().breaker_slow_ms)
    for item in args.breaker_slow_ms:
        stage, _, ms = item.partition("=")
        try:
            slow[stage.strip()] = float(ms)
        except ValueError:
            raise ValueError(f"--breaker-slow-ms {item!r}: expected STAGE=MS, e.g. tts=1500") from None
    from pipeline.llm.loader import LLM_CHOICES
    from pipeline.serving.faults import parse_rules

    fallback = args.fallback_llm.strip()
    if fallback not in ("auto", "none", *LLM_CHOICES) and not Path(fallback).is_dir():
        raise ValueError(f"--fallback-llm {fallback!r}: use auto, none, one of {', '.join(LLM_CHOICES)} or a local "
                         "transformers folder")
    env = os.environ.get("VOXPIPE_FAULTS")
    faults = tuple(args.fault)
    if env is not None:
        try:
            parse_rules([env])
        except ValueError as exc:
            raise ValueError(f"VOXPIPE_FAULTS: {exc}") from None
        faults += (env,)
    return cls(faults=faults, fallback_llm=args.fallback_llm, preload_fallback=args.preload_fallback,
               ladder_calm_s=args.ladder_calm_s, breaker_open_s=args.breaker_open_s, breaker_slow_ms=slow,
               adapt=not args.no_adapt, adapt_down_s=args.adapt_down_s)


async def _serve_async(cfg, ray_opts: dict | None = None) -> int:
    from pipeline.cpu_share import in_own_thread
    from pipeline.engines import load_engines, warm_up
    from server.app import VoxpipeServer

    log = logging.getLogger("voxpipe")
    if ray_opts is None:
        log.info("loading models (the first start converts the LLM once; later starts are fast)")
        from pipeline.llm.types import RemoteLlmUnavailable

        try:
            engines = await in_own_thread(load_engines, cfg)  # its OpenMP team ends with it
        except RemoteLlmUnavailable as exc:
            print(f"voxpipe: {exc}", file=sys.stderr)
            return 2
        except (ValueError, FileNotFoundError) as exc:  # a model name or path that is not there
            log.debug("model loading failed", exc_info=True)
            print(f"voxpipe: bad configuration: {exc}", file=sys.stderr)
            return 2
    else:
        from pipeline.remote.connect import connect_engines

        log.info("Ray Serve: deploying the model stages (%s)", ray_opts["address"])
        engines = await asyncio.to_thread(connect_engines, cfg, **ray_opts)
    app = VoxpipeServer(engines, cfg)
    server = await app.serve()
    await warm_up(engines)
    app.governor.faults.arm()  # calls are counted from here: the warm-up's are not
    app.ready = True
    host, port = cfg.server.host, cfg.server.port
    if ":" in host and not host.startswith("["):  # an IPv6 address goes in brackets in a URL
        host = f"[{host}]"
    log.info("voxpipe ready: ws://%s:%d/ws  web demo: http://%s:%d/", host, port, host, port)
    print(f"voxpipe ready on ws://{host}:{port}/ws (web demo http://{host}:{port}/)", flush=True)
    if cfg.server.token:
        print("clients need the token: the web demo as http://HOST:PORT/?token=TOKEN, ask/mic with --token or "
              "VOXPIPE_TOKEN", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, app.governor.faults.clear)  # a drill's end: stop injecting faults
    await stop.wait()
    server.close()
    await server.wait_closed()
    await app.stop_tasks()
    engines.stop()
    if ray_opts is not None:
        from pipeline.remote.connect import disconnect

        disconnect()
    return 0
