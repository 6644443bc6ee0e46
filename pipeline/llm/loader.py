"""Load the chat LLM with transformers: GGUF → safetensors cache folder → model.

transformers dequantizes GGUF on every load, which takes tens of seconds on a CPU, so the
first load converts once into ``$VOXPIPE_CACHE/llm/<name>`` and later loads read that
folder (safetensors: no dequantizing).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import model_files

logger = logging.getLogger(__name__)

_CONVERT_LOCK = threading.Lock()

LLM_CHOICES = ("qwen", "qwen1.5b", "smollm2")
"""Names accepted by ``--llm`` besides a local folder path."""


@dataclass(slots=True)
class LoadedLLM:
    """A causal LM ready for decoding.

    Attributes:
        model: ``transformers`` causal LM in eval mode.
        tokenizer: its tokenizer (with chat template).
        name: short name (``qwen``, ``smollm2`` or the folder name).
        device: ``torch.device`` the weights live on.
        dtype: ``torch.dtype`` of the weights.
    """

    model: Any
    tokenizer: Any
    name: str
    device: Any
    dtype: Any


def _gguf_for(name: str) -> Path:
    if name == "smollm2":
        return model_files.smollm2_gguf()
    if name == "qwen":
        return model_files.qwen_gguf()
    if name == "qwen1.5b":
        return model_files.qwen15_gguf()
    raise ValueError(f"unknown LLM {name!r}: use one of {LLM_CHOICES} or a local folder")


def _convert(gguf: Path, dest: Path) -> None:
    """Dequantize ``gguf`` with transformers and save a safetensors folder at ``dest``."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"converting {gguf.name} (once)", unit="step")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    steps.update()
    # The weights are plain bf16 tensors now; forget the GGUF "quantizer" so that
    # save_pretrained writes an ordinary safetensors checkpoint.
    setattr(model, "hf_quantizer", None)  # noqa: B010 - torch types module attributes as Tensor | Module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    setattr(model, "is_quantized", False)  # noqa: B010
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    tmp.replace(dest)
    steps.update()
    steps.close()


def llm_folder(name: str) -> Path:
    """Return a safetensors folder for ``name``, converting from GGUF on first use.

    Args:
        name: ``qwen``, ``smollm2``, or a path to a local transformers model folder.

    Threads and processes that ask at once convert once (a thread lock, then a file lock
    beside the folder); the others wait for it.

    Raises:
        ValueError: unknown name, or a GGUF that fails its hash check.
        ModelNotInstalled: the model package is not installed.
    """
    if os.path.isdir(name):
        return Path(name)
    from filelock import FileLock

    dest = model_files.cache_dir() / "llm" / name
    with _CONVERT_LOCK:
        if (dest / "config.json").exists():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        # two processes starting on an empty cache (two servers, a bench and a test) convert
        # once: the second waits for the first's folder instead of racing it into place
        with FileLock(str(dest.parent / f"{name}.lock")):
            if not (dest / "config.json").exists():
                gguf = _gguf_for(name)
                logger.info("converting %s into %s (once)", gguf, dest)
                _convert(gguf, dest)
    return dest


DEVICES = ("auto", "cpu", "cpu-fp32", "cpu-int4", "cpu-int8", "cuda")
"""``--device`` choices: ``cpu`` is bf16; ``cpu-int4`` / ``cpu-int8`` are weight-only
quantized linear layers (group-wise int4 / per-channel int8, bf16 activations and KV,
:mod:`pipeline.llm.runner.quant_linear`); int4 on voxpipe's kernel runs every step, int8 and
PyTorch's int4 kernel (and voxpipe's on a CPU with AMX) only steps of a few rows, with a bf16
copy for prefill and wide batches; the embedding stays bf16."""

QUANT_DEVICES = {"cpu-int4": "int4", "cpu-int8": "int8"}
"""``--device`` values that quantize the linear layers, and the quantization they use."""


def check_device(device: str) -> None:
    """Check a ``--device`` value before anything loads.

    Raises:
        ValueError: not one of :data:`DEVICES` or ``cuda:N``, or CUDA asked of a torch that
            sees no CUDA device.
    """
    if device not in DEVICES and not device.startswith("cuda:"):
        raise ValueError(f"--device {device!r}: use one of {', '.join(DEVICES)} or cuda:N")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: this torch sees no CUDA device (use --device auto or cpu)")


def resolve_device(device: str = "auto") -> str:
    """``device`` with ``auto`` made concrete: ``cuda`` when available, else ``cpu-int4``
    when the CPU runs bf16 natively (oneDNN AVX-512 BF16 / AMX: the int4 decode kernels and
    the bf16 prefill copy are fast there), else ``cpu-fp32``. ``cpu-int4`` is the CPU
    default because decode reads every weight once per token, a quarter of the bytes in int4
    (voice-to-voice before and after: docs/BENCHMARKS.md), for a perplexity ratio pinned
    ≤ 1.05 by tests/test_quant_quality.py (``bench quant``)."""
    if device != "auto":
        return device
    import torch

    from pipeline.llm.runner.cpu_linear import packing_supported

    return "cuda" if torch.cuda.is_available() else "cpu-int4" if packing_supported() else "cpu-fp32"


def pick_device(device: str = "auto") -> tuple[Any, Any]:
    """(device, dtype) of :func:`resolve_device`'s choice: ``cpu`` is bf16; ``cpu-fp32``
    loads fp32 weights; ``cpu-int4`` and ``cpu-int8`` load bf16 weights (quantized after
    loading); CUDA bf16."""
    import torch

    device = resolve_device(device)
    if device == "cpu-fp32":
        return torch.device("cpu"), torch.float32
    if device in QUANT_DEVICES:
        return torch.device("cpu"), torch.bfloat16
    return torch.device(device), torch.bfloat16


def load_tokenizer(path: str) -> Any:
    """A local Hugging Face tokenizer folder (``tokenizer.json``/``tokenizer_config.json``,
    e.g. a model's folder), read offline (``local_files_only``): ``--tokenizer PATH``.

    Raises:
        FileNotFoundError: ``path`` is not a folder.
        ValueError: the folder holds no tokenizer transformers can load.
    """
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"--tokenizer {path}: not a folder (give a local Hugging Face tokenizer folder)")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--tokenizer {path}: no tokenizer could be loaded from it ({exc})") from None


def load_llm(name: str, *, device: str = "auto", threads: int | None = None,
             quant_head: bool | None = None, native_int4: bool | None = None) -> LoadedLLM:
    """Load the chat model ``name`` (see :func:`llm_folder`) for inference.

    Args:
        name: ``qwen``, ``smollm2`` or a local folder.
        device: one of :data:`DEVICES` or ``cuda:N`` (``auto``: :func:`resolve_device`).
        threads: torch intra-op threads on CPU (each engine gets its own budget of cores).
        quant_head: with ``cpu-int4``/``cpu-int8``, quantize the LM head too (None: when
            it is not tied to the input embedding, :func:`~pipeline.llm.runner.quant_linear.quantize_linears`).
        native_int4: with ``cpu-int4``, voxpipe's own kernel (None: where the CPU has it;
            False: PyTorch's, for comparison).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    folder = llm_folder(name)
    device = resolve_device(device)
    dev, dtype = pick_device(device)
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(dev).eval()
    if device in QUANT_DEVICES:
        from pipeline.llm.runner.quant_linear import quantize_linears

        logger.info("%s", quantize_linears(model, QUANT_DEVICES[device], lm_head=quant_head, native=native_int4))
    if dev.type == "cpu" and dtype == torch.bfloat16:
        from pipeline.llm.runner.cpu_linear import pack_linears

        logger.info("pre-packed %d bf16 linear layers for oneDNN", pack_linears(model))
    if dev.type == "cpu":
        from pipeline.llm.runner.own_memory import own_weights

        # the weights file's memory map: released, and no page fault per new token's embedding
        logger.info("copied out of the weights file's memory map: %s", own_weights(model))
    short = name if name in LLM_CHOICES else folder.name
    return LoadedLLM(model=model, tokenizer=tok, name=short, device=dev, dtype=dtype)
