"""Join a Ray cluster, deploy (or find) the stage deployments, and hand back
:class:`~pipeline.engines.Engines` whose ASR, LLM and TTS are remote (VAD stays local: it
runs per 32 ms window of every session; so does the small end-of-turn model, when
``--end-of-turn smart-turn`` asks for it)."""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from audio.vad import SileroVad
from pipeline import model_files
from pipeline.config import VoxpipeConfig
from pipeline.engines import Engines, fallback_model, load_eot, open_tools
from pipeline.remote.app import build_app
from pipeline.remote.clients import RemoteAsr, RemoteLlm, RemoteStage, RemoteTts
from pipeline.remote.settings import deployment_options, read_serve_config
from pipeline.remote.types import APP_NAME

logger = logging.getLogger(__name__)


def init_ray(address: str, *, num_cpus: int | None = None) -> bool:
    """Connect this process to Ray (once): ``auto`` joins the cluster this machine belongs
    to (``ray start``, ``RAY_ADDRESS``) or, when there is none, starts a local one with
    ``num_cpus`` CPUs (None: all); any other value is a cluster address (``HOST:PORT``).
    Returns whether a local cluster was started (it ends with this process).

    Raises:
        ConnectionError: no cluster answers at ``address``.
    """
    if ray.is_initialized():
        return False
    if address != "auto":
        ray.init(address=address, log_to_driver=False)
        return False
    try:
        ray.init(address="auto", log_to_driver=False)
        return False
    except ConnectionError:
        logger.info("no Ray cluster found: starting a local one")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    return True


def deploy(cfg: VoxpipeConfig, overrides: dict[str, dict[str, Any]] | None = None, *,
           app_name: str = APP_NAME) -> None:
    """Deploy (or update) the stage application from ``cfg`` and ``overrides`` and wait
    until every replica has loaded and warmed up its model. No HTTP proxy is started: the
    front end calls the deployments through handles."""
    t0 = time.perf_counter()
    serve.start(proxy_location="Disabled")
    serve.run(build_app(cfg, overrides), name=app_name, route_prefix=None)
    logger.info("Serve application %r ready in %.1f s", app_name, time.perf_counter() - t0)


def remote_engines(cfg: VoxpipeConfig, *, app_name: str = APP_NAME,
                   llm_options: dict[str, Any] | None = None) -> Engines:
    """Engines over the deployed application ``app_name``: local VAD, remote ASR/LLM/TTS;
    each client's load cache is filled once (blocking: call off the event loop) and then
    refreshed in the background. ``llm_options``: the ``llm`` deployment's options, for
    :class:`RemoteLlm`'s capacity (None: only the replicas' queues bound it).

    Raises:
        ray.serve.exceptions.RayServeException: no such application or deployment;
        TimeoutError and Ray's errors: a stage's replicas do not answer.
    """
    handles = [serve.get_deployment_handle(stage, app_name=app_name) for stage in ("asr", "llm", "tts")]
    return engines_from_handles(cfg, *handles, llm_options=llm_options)


def engines_from_handles(cfg: VoxpipeConfig, asr_handle: DeploymentHandle, llm_handle: DeploymentHandle,
                         tts_handle: DeploymentHandle, *, llm_options: dict[str, Any] | None = None,
                         timeout_s: float = 60.0) -> Engines:
    """:func:`remote_engines` over the stage deployments' handles (e.g. an ingress's bound
    ones); waits up to ``timeout_s`` for each stage's first stats (blocking)."""
    opts = llm_options or {}
    queued = opts.get("max_queued_requests")
    vad = SileroVad(model_files.silero_vad_path(), gate=cfg.turn.vad_gate)
    asr = RemoteAsr(asr_handle)
    llm = RemoteLlm(llm_handle, queue_size=cfg.llm.queue_size, max_ongoing=opts.get("max_ongoing_requests"),
                    max_queued=None if queued is None else int(queued))
    tts = RemoteTts(tts_handle)
    stages: tuple[RemoteStage, ...] = (asr, llm, tts)
    for stage in stages:
        stage.poller.refresh(timeout_s=timeout_s)
    engines = Engines(vad=vad, asr=asr, llm=llm, tts=tts, eot=load_eot(cfg), tools=open_tools(cfg))
    engines.start()
    return engines


def connect_engines(cfg: VoxpipeConfig, address: str, *, config_path: str | None = None,
                    replicas: dict[str, int] | None = None, existing: bool = False,
                    num_cpus: int | None = None, app_name: str = APP_NAME) -> Engines:
    """``voxpipe serve --ray``: join the cluster (:func:`init_ray`), deploy the stages from
    ``cfg`` with the options of ``config_path`` (a Serve config file) and ``replicas``
    (``{stage: num_replicas}``) on top — or, with ``existing``, use the application already
    deployed — and return its :func:`remote_engines`. Slow: call off the event loop.

    Raises:
        ConnectionError, OSError, ValueError: no cluster; an unreadable or bad config file.
    """
    if fallback_model(cfg) is not None:
        logger.info("--ray: no fallback LLM (degraded turns stay on the llm deployment)")
    overrides = read_serve_config(config_path, app_name) if config_path else {}
    for stage, n in (replicas or {}).items():
        entry = overrides.setdefault(stage, {})
        entry.pop("autoscaling_config", None)
        entry["num_replicas"] = n
    init_ray(address, num_cpus=num_cpus)
    if not existing:
        deploy(cfg, overrides, app_name=app_name)
    return remote_engines(cfg, app_name=app_name, llm_options=deployment_options("llm", cfg, overrides.get("llm")))


def disconnect() -> None:
    """Leave the cluster (a local cluster this process started ends with it; the
    deployments on a shared cluster keep running)."""
    if ray.is_initialized():
        ray.shutdown()
