"""The Serve application: three stage deployments behind a directory ingress.

``serve run pipeline.remote.app:app`` (defaults) or ``serve deploy deploy/ray-serve.yaml``
(per-stage options and model choices) deploys it; ``voxpipe serve --ray`` builds it from its
own options with :func:`build_app` and deploys it with ``serve.run``.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application, Deployment

from pipeline.config import VoxpipeConfig
from pipeline.remote.replicas import ASR, DIRECTORY, LLM, TTS
from pipeline.remote.settings import deployment_options
from pipeline.remote.types import RemoteStageName


def build_app(cfg: VoxpipeConfig | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Application:
    """The voxpipe application: ``asr``, ``llm`` and ``tts`` deployments, each told its
    model settings from ``cfg`` (``user_config``), with :data:`~pipeline.remote.settings.DEFAULT_OPTIONS`
    and then ``overrides[stage]`` (Serve deployment options, as in a Serve config file) on top.

    Raises:
        ValueError: see :func:`~pipeline.remote.settings.deployment_options`.
    """
    return DIRECTORY.bind(*bind_stages(cfg or VoxpipeConfig(), overrides or {}))


def bind_stages(cfg: VoxpipeConfig, overrides: dict[str, dict[str, Any]]) -> tuple[Application, ...]:
    """The bound ``asr``, ``llm`` and ``tts`` deployments of :func:`build_app` (for an
    ingress to bind: :mod:`server.ingress`)."""
    stages: tuple[tuple[RemoteStageName, Deployment], ...] = (("asr", ASR), ("llm", LLM), ("tts", TTS))
    return tuple(dep.options(**deployment_options(name, cfg, overrides.get(name))).bind() for name, dep in stages)


app = build_app()
"""The application with voxpipe's defaults (Qwen, Whisper tiny.en, Piper joe): the import
path of ``deploy/ray-serve.yaml``, whose ``deployments`` entries override its options."""
