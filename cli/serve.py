"""``voxpipe serve``: flags → :class:`~pipeline.config.VoxpipeConfig`, models, the server."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import LlmConfig, VoxpipeConfig


def runtime_env() -> None:
    """Thread and memory settings for the model runtimes, before any model loads (a user's
    own environment wins): idle OpenMP threads sleep instead of spinning (2-core budget),
    after a spin of :data:`pipeline.cpu_share.OMP_SPIN_COUNT` between a step's kernels; and oneDNN keeps at
    most 256 compiled kernels — one per linear-layer shape and token count (the LLM runner
    rounds step lengths up to multiples of 8, so its working set fits); the default 1024 let
    RSS grow as steps of new lengths came (docs/BENCHMARKS.md)."""
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
    try:
        cfg = serve_config(args)
        ray_opts = ray_options(args)
    except ValueError as exc:
        print(f"voxpipe: bad configuration: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve_async(cfg, ray_opts))


def serve_config(args) -> VoxpipeConfig:
    """The validated configuration of ``voxpipe serve``'s parsed flags
    (:func:`cli.flags.config_from_args`), after the start-up checks that look past the config:
    model names and folders, the ``--tts`` choice, the flags that go with a remote LLM.

    Raises:
        ValueError: a bad flag, environment variable or combination, in one line.
    """
    from cli.flags import config_from_args
    from pipeline.tts.choice import resolve_tts

    cfg = config_from_args(args)
    _check_fallback(cfg.degrade.fallback_llm)
    cfg.tts = resolve_tts(cfg.tts)
    _check_llm(cfg.llm, ray=args.ray is not None)
    return cfg.validate()


def _check_llm(llm: LlmConfig, *, ray: bool) -> None:
    """Validate ``--llm`` (a name, a local folder or ``openai:URL[#MODEL]``), ``--device`` and
    the flags that only go with a remote LLM (``ray``: ``--ray`` was given).

    Raises:
        ValueError: an unknown name or ``--device``, a bad URL, or
            ``--tokenizer``/``--llm-api-key`` without a remote LLM.
    """
    from pipeline.llm.loader import LLM_CHOICES, check_device
    from pipeline.llm.types import RemoteLlmSpec

    check_device(llm.device)
    if not RemoteLlmSpec.is_remote(llm.model):
        if llm.model not in LLM_CHOICES and not Path(llm.model).is_dir():
            raise ValueError(f"--llm {llm.model!r}: use one of {', '.join(LLM_CHOICES)}, a local transformers folder "
                             "or openai:URL[#MODEL]")
        if llm.tokenizer or llm.api_key:
            raise ValueError("--tokenizer and --llm-api-key go with --llm openai:URL (a local model counts with "
                             "its own tokenizer)")
        return
    RemoteLlmSpec.parse(llm.model)
    if ray:
        raise ValueError("--llm openai:URL does not run in Ray Serve deployments: drop --ray")
    if llm.tokenizer and not Path(llm.tokenizer).is_dir():
        raise ValueError(f"--tokenizer {llm.tokenizer}: not a folder (give a local Hugging Face tokenizer folder)")


def _check_fallback(name: str) -> None:
    """Validate ``--fallback-llm``: ``auto``, ``none``, a model name or a local folder.

    Raises:
        ValueError: none of these.
    """
    from pipeline.llm.loader import LLM_CHOICES

    fallback = name.strip()
    if fallback not in ("auto", "none", *LLM_CHOICES) and not Path(fallback).is_dir():
        raise ValueError(f"--fallback-llm {fallback!r}: use auto, none, one of {', '.join(LLM_CHOICES)} or a local "
                         "transformers folder")


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
