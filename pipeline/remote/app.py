"""The Serve application: three stage deployments behind a directory ingress.

``serve run pipeline.remote.app:app`` (defaults) or ``serve deploy deploy/ray-serve.yaml``
(per-stage options and model choices) deploys it; ``voxpipe serve --ray`` builds it from its
own options with :func:`build_app` and deploys it with ``serve.run``.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from pipeline.config import VoxpipeConfig
from pipeline.remote.replicas import ASR, DIRECTORY, LLM, TTS
from pipeline.remote.settings import deployment_options


def build_app(cfg: VoxpipeConfig | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Application:
    """The voxpipe application: ``asr``, ``llm`` and ``tts`` deployments, each told its
    model settings from ``cfg`` (``user_config``), with :data:`~pipeline.remote.settings.DEFAULT_OPTIONS`
    and then ``overrides[stage]`` (Serve deployment options, as in a Serve config file) on top.

    Raises:
        ValueError: see :func:`~pipeline.remote.settings.deployment_options`.
    """
    cfg = cfg or VoxpipeConfig()
    overrides = overrides or {}
    asr = ASR.options(**deployment_options("asr", cfg, overrides.get("asr"))).bind()
    llm = LLM.options(**deployment_options("llm", cfg, overrides.get("llm"))).bind()
    tts = TTS.options(**deployment_options("tts", cfg, overrides.get("tts"))).bind()
    return DIRECTORY.bind(asr, llm, tts)


app = build_app()
"""The application with voxpipe's defaults (Qwen, Whisper tiny.en, Piper joe): the import
path of ``deploy/ray-serve.yaml``, whose ``deployments`` entries override its options."""
