"""What each stage deployment is told: its model settings (Serve's ``user_config``, plain
JSON, so ``deploy/ray-serve.yaml`` can carry them) and its deployment options.

A stage's ``user_config`` is a partial :class:`~pipeline.config.VoxpipeConfig` as nested
dicts: ``{"asr": {...}}`` for ASR, ``{"llm": {...}, "llm_batch": {...}}`` for the LLM,
``{"tts": {...}}`` for TTS, each with an optional ``"degrade": {...}`` (breaker, ladder and
fault-injection settings, which run inside the replica). Keys left out keep their defaults.
No ray import here.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

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
from pipeline.cpu_share import OMP_SPIN_COUNT
from pipeline.remote.types import FRONTEND_NAME, INGRESS_NAME, RemoteStageName

SECTIONS: dict[str, type] = {"asr": AsrConfig, "llm": LlmConfig, "llm_batch": SchedulerConfig, "tts": TtsConfig,
                             "degrade": DegradeConfig}
"""The ``user_config`` sections a replica understands, and the config class of each."""
FRONTEND_SECTIONS: dict[str, type] = {**SECTIONS, "turn": TurnConfig, "admission": AdmissionConfig,
                                      "server": ServerConfig}
"""The sections the Serve ingress's ``user_config`` may carry (:mod:`server.ingress`)."""
STAGE_SECTIONS: dict[RemoteStageName, tuple[str, ...]] = {
    "asr": ("asr", "degrade"), "llm": ("llm", "llm_batch", "degrade"), "tts": ("tts", "degrade")}
"""Which sections each stage's ``user_config`` carries."""

DEFAULT_OPTIONS: dict[RemoteStageName, dict[str, Any]] = {
    # max_ongoing_requests covers the engine's own queue (64) and batch plus headroom for the
    # short calls (stats, count_tokens, health checks), so the engine's bounded queue — the
    # same one the in-process server has — is what fills first; max_queued_requests bounds
    # what waits in each caller for a replica (more: BackPressureError -> busy).
    "asr": {"num_replicas": 1, "max_ongoing_requests": 96, "max_queued_requests": 64,
            "ray_actor_options": {"num_cpus": 0.5}},
    "llm": {"num_replicas": 1, "max_ongoing_requests": 96, "max_queued_requests": 64,
            "ray_actor_options": {"num_cpus": 1}},
    "tts": {"num_replicas": 1, "max_ongoing_requests": 96, "max_queued_requests": 64,
            "ray_actor_options": {"num_cpus": 0.5}},
}
"""Each stage deployment's options unless the caller (``--ray-config``, ``--ray-replicas``,
the YAML) says otherwise. Fractional CPUs: the three fit a 2-CPU Ray node."""
HEALTH_OPTIONS: dict[str, float] = {"health_check_period_s": 10.0, "health_check_timeout_s": 30.0,
                                    "graceful_shutdown_timeout_s": 5.0}
"""Serve calls each replica's ``check_health`` (a tiny forward pass) this often."""
RUNTIME_ENV_VARS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(OMP_SPIN_COUNT),
                    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}
"""Thread settings every replica process gets (as ``voxpipe serve`` sets for itself)."""


def stage_user_config(cfg: VoxpipeConfig, stage: RemoteStageName) -> dict[str, Any]:
    """The ``user_config`` of ``stage``'s deployment from the front end's ``cfg`` (every
    field of its sections, JSON-ready: tuples become lists)."""
    out: dict[str, Any] = {}
    for section in STAGE_SECTIONS[stage]:
        values = dataclasses.asdict(getattr(cfg, section))
        out[section] = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    return out


def frontend_user_config(cfg: VoxpipeConfig) -> dict[str, Any]:
    """The Serve ingress's ``user_config`` from ``cfg``: every :data:`FRONTEND_SECTIONS`
    section, JSON-ready (tuples become lists)."""
    return {s: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(getattr(cfg, s)).items()}
            for s in FRONTEND_SECTIONS}


def config_from_user(user_config: dict[str, Any] | None, sections: dict[str, type] = SECTIONS) -> VoxpipeConfig:
    """A validated :class:`VoxpipeConfig` from a stage's ``user_config`` (missing sections
    and keys keep their defaults; ``sections``: those allowed, :data:`FRONTEND_SECTIONS` for
    the ingress; lists become tuples where the field's default is a tuple).

    Raises:
        ValueError: an unknown section or key, a value of the wrong kind, or a value the
            config's cross-checks reject.
    """
    cfg = VoxpipeConfig()
    for section, values in (user_config or {}).items():
        cls = sections.get(section)
        if cls is None:
            raise ValueError(f"user_config: unknown section {section!r} (known: {', '.join(sections)})")
        if not isinstance(values, dict):
            raise ValueError(f"user_config.{section}: expected a mapping, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"user_config.{section}: unknown keys {unknown}")
        tuples = {f.name for f in dataclasses.fields(cls) if isinstance(getattr(cls(), f.name), tuple)}
        fixed = {k: tuple(v) if isinstance(v, list) and k in tuples else v for k, v in values.items()}
        try:
            setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **fixed))
        except TypeError as exc:
            raise ValueError(f"user_config.{section}: {exc}") from None
    return cfg.validate()


def deployment_options(stage: RemoteStageName, cfg: VoxpipeConfig,
                       overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``Deployment.options(...)`` keywords for ``stage``: :data:`DEFAULT_OPTIONS`,
    :data:`HEALTH_OPTIONS`, the thread settings in ``runtime_env`` and the ``user_config``
    from ``cfg``, then ``overrides`` (a deployment entry of a Serve config: ``num_replicas``
    or ``autoscaling_config``, ``max_ongoing_requests``, ``ray_actor_options``, ...;
    ``ray_actor_options`` and ``user_config`` are merged one level deep).

    Raises:
        ValueError: both ``num_replicas`` and ``autoscaling_config`` end up set.
    """
    opts: dict[str, Any] = {**copy.deepcopy(DEFAULT_OPTIONS[stage]), **HEALTH_OPTIONS}
    opts["ray_actor_options"]["runtime_env"] = {"env_vars": dict(RUNTIME_ENV_VARS)}
    opts["user_config"] = stage_user_config(cfg, stage)
    for key, value in (overrides or {}).items():
        if key == "name":
            continue
        if key in ("ray_actor_options", "user_config") and isinstance(value, dict):
            merged = opts[key]
            for k, v in value.items():
                merged[k] = {**merged[k], **v} if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
        else:
            opts[key] = value
    if "autoscaling_config" in (overrides or {}) and "num_replicas" not in (overrides or {}):
        opts.pop("num_replicas", None)
    if opts.get("autoscaling_config") and opts.get("num_replicas") not in (None, "auto"):
        raise ValueError(f"{stage}: give num_replicas or autoscaling_config, not both")
    return opts


def capacity(opts: dict[str, Any], replicas: int) -> int | None:
    """Requests one front end may have in flight to a deployment with options ``opts`` and
    ``replicas`` replicas before Serve's router refuses more (``BackPressureError``):
    ``replicas × max_ongoing_requests + max_queued_requests``; None when unbounded."""
    queued = int(opts.get("max_queued_requests", -1))
    if queued < 0:
        return None
    return max(1, replicas) * int(opts.get("max_ongoing_requests", 5)) + queued


def read_serve_config(path: str, app_name: str) -> dict[str, dict[str, Any]]:
    """The per-stage deployment options of application ``app_name`` in a Serve config file
    (``serve deploy`` format, e.g. ``deploy/ray-serve.yaml``): ``{stage: {option: value}}``.

    Raises:
        OSError: the file cannot be read; ValueError: it is not a Serve config, has no
            application ``app_name``, or names a deployment that is not a stage.
    """
    import yaml

    with open(path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    apps = doc.get("applications") if isinstance(doc, dict) else None
    if not isinstance(apps, list):
        raise ValueError(f"{path}: not a Serve config (no 'applications' list)")
    app = next((a for a in apps if isinstance(a, dict) and a.get("name") == app_name), None)
    if app is None:
        raise ValueError(f"{path}: no application named {app_name!r}")
    out: dict[str, dict[str, Any]] = {}
    for dep in app.get("deployments") or []:
        name = dep.get("name")
        if name in (INGRESS_NAME, FRONTEND_NAME):
            continue
        if name not in STAGE_SECTIONS:
            raise ValueError(f"{path}: deployment {name!r} is not a stage (asr, llm, tts; stages, frontend)")
        out[name] = {k: v for k, v in dep.items() if k != "name"}
    return out
