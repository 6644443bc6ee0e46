"""``python -m bench.make_random_vits DIR``: write a tiny VITS model folder with random weights,
built from Coqui TTS's own config classes — what the Coqui backend's tests
(tests/test_tts_coqui.py) and ``voxpipe bench voice --variant coqui="--tts coqui:DIR"`` load.
It speaks noise, not words: it measures the backend's overhead, not a voice. Needs the
``coqui`` extra (``pip install -e ".[coqui]"``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RANDOM_VITS_RATE = 22050
"""Output rate of the random model (Hz): Coqui's default audio config, unlike the
session's usual 24 kHz, so the session's resampling is exercised."""


def write_random_vits(folder: str | Path, *, seed: int = 0) -> Path:
    """Write ``config.json`` + ``model.pth`` of a small single-speaker VITS (characters,
    no phonemizer, hidden sizes of 32-64, about 0.5 M parameters, the deterministic duration
    predictor) with random weights (``torch.manual_seed(seed)``) into ``folder`` (created if
    missing). A phrase's length then depends on its text only.

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
    torch.manual_seed(seed)
    model = Vits(config)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    config.save_json(str(out / "config.json"))
    torch.save({"model": model.state_dict()}, out / "model.pth")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.make_random_vits DIR``: write the folder, print its path."""
    p = argparse.ArgumentParser(description="write a random tiny Coqui VITS model folder (for tests and benches)")
    p.add_argument("folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        print(write_random_vits(args.folder, seed=args.seed))
    except ImportError as exc:
        print(f"voxpipe: coqui-tts cannot be imported ({exc}): pip install -e \".[coqui]\"", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
