"""A Coqui TTS model folder (``--tts coqui:PATH``: ``config.json`` + a checkpoint), checked at
start-up without loading anything: nothing here imports torch or coqui-tts.

Supported model kinds: :data:`SUPPORTED_KINDS` — VITS with one speaker and one language
(characters, or phonemes when the config's phonemizer is installed). Multi-speaker or
multilingual VITS (YourTTS), XTTS, Bark, Tortoise and the spectrogram models that need a
separate vocoder (Tacotron 2, Glow-TTS, ...) are refused at start-up.
"""

from __future__ import annotations

import importlib.util
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_KINDS = ("vits",)
"""Values of ``config.json``'s ``model`` this backend loads."""
_CHECKPOINT_NAMES = ("model.pth", "model_file.pth", "best_model.pth")
_STEP_CHECKPOINT = re.compile(r"checkpoint_(\d+)\.pth")
_PER_SPEAKER_ARGS = ("use_speaker_embedding", "use_d_vector_file", "use_language_embedding")


@dataclass(frozen=True, slots=True)
class CoquiModelFolder:
    """A checked model folder: its ``config.json``, its checkpoint and the model kind."""

    config: Path
    checkpoint: Path
    kind: str


def check_model_folder(path: str | Path) -> CoquiModelFolder:
    """Check a Coqui model folder without loading anything (start-up flag check): the folder
    exists, holds ``config.json`` naming a supported model kind with one speaker and one
    language, and a checkpoint — ``model.pth``, ``model_file.pth``, ``best_model.pth`` or
    else the ``checkpoint_N.pth`` with the highest N (the names Coqui's trainer and model
    zoo write).

    Raises:
        ValueError: one line saying what is missing or unsupported.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"Coqui model folder not found: {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"Coqui model folder {folder} has no config.json")
    try:
        with open(config_path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_path}: not a readable JSON config ({exc})") from None
    kind = str(config.get("model", "")).lower() if isinstance(config, dict) else ""
    supported = ", ".join(SUPPORTED_KINDS)
    if kind not in SUPPORTED_KINDS:
        raise ValueError(f"{config_path}: Coqui model kind {kind or '(none)'!r} is not supported; "
                         f"supported: {supported} (one speaker, one language)")
    args = config.get("model_args") if isinstance(config.get("model_args"), dict) else {}
    per_speaker = [name for name in _PER_SPEAKER_ARGS if args.get(name)]
    if per_speaker:
        raise ValueError(f"{config_path}: multi-speaker or multilingual {kind} ({', '.join(per_speaker)}) is "
                         f"not supported; supported: {supported} with one speaker and one language")
    if config.get("use_phonemes") and not config.get("phonemizer"):
        raise ValueError(f"{config_path}: use_phonemes is set but no phonemizer is configured")
    checkpoint = _checkpoint(folder)
    if checkpoint is None:
        raise ValueError(f"Coqui model folder {folder} has no checkpoint "
                         f"({', '.join(_CHECKPOINT_NAMES)} or checkpoint_N.pth)")
    if _truncated_zip(checkpoint):
        raise ValueError(f"{checkpoint}: a truncated or corrupt PyTorch checkpoint (its zip archive is incomplete)")
    return CoquiModelFolder(config=config_path, checkpoint=checkpoint, kind=kind)


def _truncated_zip(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` is a zip archive (``torch.save``'s format) without its end (an
    interrupted copy or download): cheap to tell here, a traceback once torch loads it. Other
    formats (legacy pickles) are left to the loader."""
    try:
        with open(checkpoint, "rb") as fh:
            if fh.read(4) != b"PK\x03\x04":
                return False
        return not zipfile.is_zipfile(checkpoint)
    except OSError:
        return False


def _checkpoint(folder: Path) -> Path | None:
    for name in _CHECKPOINT_NAMES:
        if (folder / name).is_file():
            return folder / name
    steps = [(int(m.group(1)), p) for p in folder.glob("checkpoint_*.pth") if (m := _STEP_CHECKPOINT.fullmatch(p.name))]
    return max(steps)[1] if steps else None


def check_coqui_installed() -> None:
    """Raises:
        ValueError: coqui-tts is not installed (one line naming the extra)."""
    if importlib.util.find_spec("TTS") is None:
        raise ValueError('--tts coqui needs coqui-tts: pip install -e ".[coqui]"')
