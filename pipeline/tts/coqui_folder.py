"""A Coqui TTS model folder (``--tts coqui:PATH``: ``config.json`` + a checkpoint), checked at
start-up without loading anything: nothing here imports torch or coqui-tts.

Supported model kinds: :data:`SUPPORTED_KINDS` — VITS (characters, or phonemes when the
config's phonemizer is installed), with one speaker or several named ones
(``use_speaker_embedding`` with ``speakers`` or a ``speakers_file``), in one language or several
(``use_language_embedding`` with ``languages`` or a ``language_ids_file``); each speaker (in each
language) becomes a voice of the catalogue (:mod:`pipeline.tts.coqui`). VITS with d-vectors or
a speaker encoder (YourTTS), XTTS, Bark, Tortoise and the spectrogram models that need a
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
_UNSUPPORTED_ARGS = ("use_d_vector_file", "speaker_encoder_model_path")
NAME_FILES = ("speakers_file", "speaker_file", "language_ids_file")
"""Config keys (top level or ``model_args``) naming a JSON ``{name: id}`` file: a relative or
moved path is looked up in the model folder by its file name, as Coqui's model manager does."""


@dataclass(frozen=True, slots=True)
class CoquiModelFolder:
    """A checked model folder: its ``config.json``, its checkpoint, the model kind, its speaker
    names (empty: one speaker) and its language names (empty: one language), in id order."""

    config: Path
    checkpoint: Path
    kind: str
    speakers: tuple[str, ...] = ()
    languages: tuple[str, ...] = ()


def check_model_folder(path: str | Path) -> CoquiModelFolder:
    """Check a Coqui model folder without loading anything (start-up flag check): the folder
    exists, holds ``config.json`` naming a supported model kind — with one speaker or named
    speakers, one language or named languages (their ``{name: id}`` files readable) — and a
    checkpoint — ``model.pth``, ``model_file.pth``, ``best_model.pth`` or
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
    unsupported = [name for name in _UNSUPPORTED_ARGS if args.get(name) or config.get(name)]
    if unsupported:
        raise ValueError(f"{config_path}: {kind} with d-vectors or a speaker encoder ({', '.join(unsupported)}, "
                         f"e.g. YourTTS) is not supported; supported: {supported} with one speaker or named "
                         "speakers (use_speaker_embedding)")
    speakers = _names(folder, config, args, "use_speaker_embedding", "speakers", ("speakers_file", "speaker_file"))
    languages = _names(folder, config, args, "use_language_embedding", "languages", ("language_ids_file",))
    if config.get("use_phonemes") and not config.get("phonemizer"):
        raise ValueError(f"{config_path}: use_phonemes is set but no phonemizer is configured")
    checkpoint = _checkpoint(folder)
    if checkpoint is None:
        raise ValueError(f"Coqui model folder {folder} has no checkpoint "
                         f"({', '.join(_CHECKPOINT_NAMES)} or checkpoint_N.pth)")
    if _truncated_zip(checkpoint):
        raise ValueError(f"{checkpoint}: a truncated or corrupt PyTorch checkpoint (its zip archive is incomplete)")
    return CoquiModelFolder(config=config_path, checkpoint=checkpoint, kind=kind,
                            speakers=speakers if len(speakers) > 1 else (),
                            languages=languages if len(languages) > 1 else ())


def name_file(folder: Path, value: str) -> Path:
    """Where a ``speakers_file`` / ``language_ids_file`` value points: the path if it is a
    file, else the file of that name in the model folder (a config written elsewhere names the
    trainer's path; a relative one is relative to the folder)."""
    path = Path(value).expanduser()
    if not path.is_absolute() and (folder / path).is_file():
        return folder / path
    return path if path.is_file() else folder / path.name


def _names(folder: Path, config: dict, args: dict, use: str, listed: str, files: tuple[str, ...]) -> tuple[str, ...]:
    """The speaker (or language) names of a config, in id order: none unless ``use`` is set;
    then the config's ``listed`` names, else the ``{name: id}`` JSON file one of ``files``
    names.

    Raises:
        ValueError: ``use`` is set but no names are given, or their file is missing or not a
            ``{name: id}`` JSON object.
    """
    if not (args.get(use) or config.get(use)):
        return ()
    names = config.get(listed) or args.get(listed)
    if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
        return tuple(names)
    value = next((v for key in files for v in (args.get(key), config.get(key)) if isinstance(v, str) and v), None)
    if value is None:
        raise ValueError(f"{folder / 'config.json'}: {use} is set but the config names no {listed} "
                         f"({listed} or {files[0]})")
    path = name_file(folder, value)
    try:
        with open(path, encoding="utf-8") as fh:
            ids = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder / 'config.json'}: {files[0]} {value!r}: not a readable JSON file "
                         f"({type(exc).__name__}: {exc})") from None
    if not isinstance(ids, dict) or not ids or not all(isinstance(i, int) for i in ids.values()):
        raise ValueError(f"{path}: expected a JSON object {{name: id}} of {listed}")
    return tuple(sorted(ids, key=lambda name: ids[name]))


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
