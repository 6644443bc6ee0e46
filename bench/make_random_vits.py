"""``python -m bench.make_random_vits DIR``: write a tiny VITS model folder with random weights
(``--speaker alice --speaker bob``: multi-speaker; ``--language``: multilingual),
built from Coqui TTS's own config classes — what the Coqui backend's tests
(tests/test_tts_coqui.py) and ``voxpipe bench voice --variant coqui="--tts coqui:DIR"`` load.
It speaks noise, not words: it measures the backend's overhead, not a voice. Needs the
``coqui`` extra (``pip install -e ".[coqui]"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

RANDOM_VITS_RATE = 22050
"""Output rate of the random model (Hz): Coqui's default audio config, unlike the
session's usual 24 kHz, so the session's resampling is exercised."""


def write_random_vits(folder: str | Path, *, seed: int = 0, speakers: Sequence[str] = (),
                      languages: Sequence[str] = ()) -> Path:
    """Write ``config.json`` + ``model.pth`` of a small VITS (characters, no phonemizer,
    hidden sizes of 32-64, about 0.5 M parameters, the deterministic duration predictor) with
    random weights (``torch.manual_seed(seed)``) into ``folder`` (created if missing). A
    phrase's length then depends on its text (and, with ``speakers``, its speaker) only.

    One speaker and English by default. With ``speakers`` (names), a multi-speaker VITS
    (``use_speaker_embedding``, one learned embedding per speaker) whose names are in
    ``speakers.json`` (``{name: id}``, as Coqui's trainer writes it), named in the config as
    ``speakers_file: "speakers.json"``, relative to the folder; with ``languages`` (codes), a
    multilingual one (``use_language_embedding``, ``language_ids.json`` likewise).

    The checkpoint is a dict ``{"model": state_dict}``, the layout Coqui's trainer writes
    and ``Vits.load_checkpoint`` reads.

    Returns:
        the folder.

    Raises:
        ImportError: coqui-tts is not installed.
    """
    import torch

    from pipeline.tts.coqui_loader import import_coqui

    import_coqui()
    from TTS.tts.configs.shared_configs import CharactersConfig
    from TTS.tts.configs.vits_config import VitsArgs, VitsConfig
    from TTS.tts.models.vits import Vits

    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'"
    config = VitsConfig(
        use_phonemes=False,
        phonemizer=None,
        phoneme_language="en",  # the text language (Coqui reads it even without phonemes)
        text_cleaner="multilingual_cleaners",
        characters=CharactersConfig(characters_class="TTS.tts.models.vits.VitsCharacters", pad="<PAD>",
                                    eos="<EOS>", bos="<BOS>", blank="<BLNK>", characters=letters,
                                    punctuations="!¡'(),-.:;¿? ", phonemes=None),
        model_args=VitsArgs(hidden_channels=32, hidden_channels_ffn_text_encoder=64, num_layers_text_encoder=2,
                            num_heads_text_encoder=2, num_layers_posterior_encoder=2, num_layers_flow=2,
                            upsample_initial_channel_decoder=64, resblock_kernel_sizes_decoder=[3],
                            resblock_dilation_sizes_decoder=[[1, 3, 5]], use_sdp=False, init_discriminator=False,
                            length_scale=2.0),  # random durations x 2: about 50 ms per character, near speech
    )
    config.audio.sample_rate = RANDOM_VITS_RATE
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for names, file, use, key in ((speakers, "speakers.json", "use_speaker_embedding", "speakers_file"),
                                  (languages, "language_ids.json", "use_language_embedding", "language_ids_file")):
        if names:
            (out / file).write_text(json.dumps({name: i for i, name in enumerate(names)}))
            setattr(config.model_args, use, True)
            setattr(config.model_args, key, str(out / file))  # read by Vits(config) below
    if speakers:
        config.model_args.speaker_embedding_channels = 16
    if languages:
        config.model_args.embedded_language_dim = 4
    torch.manual_seed(seed)
    model = Vits(config)
    if speakers:
        config.model_args.speakers_file = "speakers.json"  # relative to the folder, as shipped
    if languages:
        config.model_args.language_ids_file = "language_ids.json"
    config.save_json(str(out / "config.json"))
    torch.save({"model": model.state_dict()}, out / "model.pth")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.make_random_vits DIR [--speaker NAME ...] [--language NAME ...]``:
    write the folder, print its path."""
    p = argparse.ArgumentParser(description="write a random tiny Coqui VITS model folder (for tests and benches)")
    p.add_argument("folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speaker", action="append", default=[], help="a speaker name (repeat: a multi-speaker VITS)")
    p.add_argument("--language", action="append", default=[], help="a language name (repeat: a multilingual VITS)")
    args = p.parse_args(argv)
    try:
        print(write_random_vits(args.folder, seed=args.seed, speakers=args.speaker, languages=args.language))
    except ImportError as exc:
        print(f"voxpipe: coqui-tts cannot be imported ({exc}): pip install -e \".[coqui]\"", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
