"""Memory estimates for LLM admission: KV bytes per token, one step's activations, the budget.

Pure arithmetic on a model's config (any object with the transformers config attribute
names) and byte counts: no torch here (the runner measures the dtype's size, the weights and
free device memory, :class:`~pipeline.llm.runner.runner.ModelRunner`). The engine turns the
budget into its KV token budget once, at load (:func:`plan`, :class:`MemoryPlan`)::

    kv_bytes_per_token = 2 (K and V) × layers × kv_heads × head_dim × bytes per element
    request_bytes      = kv_bytes_per_token × (prompt + max_new_tokens)
    max_kv_tokens      = min(configured, (budget − weights − activations of one step) // kv_bytes_per_token)

The first line is vLLM's cache sizing (``CacheEngine.get_cache_block_size`` in
vllm/worker/cache_engine.py; ``AttentionSpec.page_size_bytes`` in vllm/v1/kv_cache_interface.py)
with a block of one token; the last is vLLM's ``determine_num_available_blocks``
(vllm/worker/worker.py: budget − weights − peak activations of a profiling step, divided
by the block size), with the activations estimated here instead of profiled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from pipeline.config import LlmConfig, SchedulerConfig
    from pipeline.llm.runner.runner import ModelRunner

logger = logging.getLogger(__name__)

GPU_MEMORY_FRACTION = 0.9
"""Share of the free CUDA memory (measured after the weights loaded) the LLM may use for
its KV cache and activations (vLLM's ``gpu_memory_utilization`` default)."""

CPU_MEMORY_FRACTION = 0.5
"""Share of the available RAM (measured after the weights loaded) the LLM may use for its
KV cache and activations when ``--memory-budget`` is not given: the other half stays for
ASR, TTS, the sessions' buffers and the rest of the machine."""

MIB = 1 << 20

_DTYPE_BYTES = {"float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "int8": 1, "qint8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_bytes(dtype: int | str | Any) -> int:
    """Bytes per element of ``dtype``: an int (returned as is), a name (``"bfloat16"``,
    ``"torch.float32"``), or anything whose ``str()`` is such a name (a ``torch.dtype``).

    Raises:
        ValueError: an unknown dtype name, or an int < 1.
    """
    if isinstance(dtype, int):
        if dtype < 1:
            raise ValueError(f"bytes per element must be >= 1, got {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return _DTYPE_BYTES[name]


def head_dim(config: Any) -> int:
    """Per-head size: ``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def kv_heads(config: Any) -> int:
    """Key/value heads (``num_key_value_heads``; ``num_attention_heads`` without GQA)."""
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def kv_bytes_per_token(config: Any, dtype: int | str | Any) -> int:
    """Bytes of KV cache one token takes in every layer:
    2 (K and V) × ``num_hidden_layers`` × ``num_key_value_heads`` × head_dim × bytes per element.

    Source: vLLM's cache block size (``CacheEngine.get_cache_block_size``,
    vllm/worker/cache_engine.py) for a block of one token. Qwen2.5-0.5B in bf16:
    2 × 24 × 2 × 64 × 2 = 12,288 bytes; SmolLM2-135M: 2 × 30 × 3 × 64 × 2 = 23,040.

    Args:
        config: a transformers model config (``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads``, ``hidden_size``, optional ``head_dim``).
        dtype: the KV cache's element type (see :func:`dtype_bytes`): the activations'
            dtype, which is fp32 for an int8-weight model.

    Raises:
        ValueError: an unknown dtype.
    """
    return 2 * int(config.num_hidden_layers) * kv_heads(config) * head_dim(config) * dtype_bytes(dtype)


def activation_bytes(config: Any, dtype: int | str | Any, tokens: int, *, attended: int | None = None,
                     logits_rows: int | None = None) -> int:
    """A simple upper-bound estimate of one forward step's peak activations (bytes) over
    ``tokens`` new tokens. Layers run one after another and free their temporaries, so one
    layer's live tensors count once, plus the attention scores and the logits::

        tokens × (2·hidden + (heads + 2·kv_heads)·head_dim + 3·intermediate) × b   residual, normed
                                                         input, q/k/v, MLP gate, up, act(gate)·up
      + tokens × hidden × 4                                RMSNorm's fp32 upcast
      + heads × tokens × attended × 4                      attention scores (fp32 softmax, eager path)
      + logits_rows × vocab × (b + 4)                      logits, and their fp32 copy for sampling

    with ``b`` = bytes per element. Not counted: the KV cache itself (see
    :func:`kv_bytes_per_token`), the rotary tables (tokens × head_dim), allocator slack.

    Args:
        config: a transformers config (``hidden_size``, ``intermediate_size``,
            ``num_attention_heads``, ``vocab_size``; ``num_key_value_heads``, ``head_dim``
            optional).
        dtype: the activations' element type (see :func:`dtype_bytes`).
        tokens: new tokens in the step (≥ 0).
        attended: KV positions each new token attends to (default ``tokens``).
        logits_rows: positions whose logits are computed (default ``tokens``; the runner
            keeps one per decoding row and per prompt chunk).

    Raises:
        ValueError: an unknown dtype, or a negative count.
    """
    if tokens < 0 or (attended or 0) < 0 or (logits_rows or 0) < 0:
        raise ValueError("tokens, attended and logits_rows must be >= 0")
    b = dtype_bytes(dtype)
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    inter = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    per_token = (2 * hidden + (heads + 2 * kv_heads(config)) * head_dim(config) + 3 * inter) * b + hidden * 4
    scores = heads * tokens * (tokens if attended is None else attended) * 4
    logits = (tokens if logits_rows is None else logits_rows) * int(config.vocab_size) * (b + 4)
    return tokens * per_token + scores + logits


def request_bytes(config: Any, dtype: int | str | Any, prompt_tokens: int, max_new_tokens: int) -> int:
    """KV bytes one request may hold: :func:`kv_bytes_per_token` × (prompt + max new tokens).

    A step's activations are shared by the whole batch, so they are reserved once in the
    budget (:func:`kv_token_budget`), not per request.

    Raises:
        ValueError: an unknown dtype, or a negative token count.
    """
    return _request_bytes(kv_bytes_per_token(config, dtype), prompt_tokens, max_new_tokens)


def _request_bytes(per_token: int, prompt_tokens: int, max_new_tokens: int) -> int:
    if prompt_tokens < 0 or max_new_tokens < 0:
        raise ValueError("prompt_tokens and max_new_tokens must be >= 0")
    return per_token * (prompt_tokens + max_new_tokens)


def budget_bytes(*, weights: int, memory_budget_mb: float = 0.0, device_free: int | None = None,
                 available_ram: int | None = None, gpu_fraction: float = GPU_MEMORY_FRACTION,
                 cpu_fraction: float = CPU_MEMORY_FRACTION) -> int:
    """The LLM's memory budget (bytes): weights + KV cache + one step's activations.

    * ``memory_budget_mb`` > 0 (``voxpipe serve --memory-budget MB``): that many MiB, on any device;
    * on CUDA (``device_free`` given: ``torch.cuda.mem_get_info()[0]`` after the weights
      loaded): weights + free × ``gpu_fraction`` (0.9);
    * on CPU: weights + available RAM (``psutil.virtual_memory().available`` unless
      ``available_ram`` is given, measured after the weights loaded, so they are not in it)
      × ``cpu_fraction`` (0.5). On a 24 GiB machine with 22 GiB available that leaves ~11 GiB
      for the KV cache: ~950,000 tokens of Qwen2.5-0.5B, far above the default
      ``max_kv_tokens`` of 16,384, which then stays the limit.

    Args:
        weights: bytes the model's weights take (already resident).

    Raises:
        ValueError: negative ``weights`` or ``memory_budget_mb``, or a fraction outside (0, 1].
    """
    if weights < 0 or memory_budget_mb < 0:
        raise ValueError("weights and memory_budget_mb must be >= 0")
    if not (0 < gpu_fraction <= 1 and 0 < cpu_fraction <= 1):
        raise ValueError("gpu_fraction and cpu_fraction must be in (0, 1]")
    if memory_budget_mb > 0:
        return int(memory_budget_mb * MIB)
    if device_free is not None:
        return weights + int(device_free * gpu_fraction)
    avail = psutil.virtual_memory().available if available_ram is None else available_ram
    return weights + int(avail * cpu_fraction)


def kv_token_budget(budget: int, weights: int, activations: int, per_token: int) -> int:
    """KV-cache tokens that fit: (budget − weights − activations) // per_token, at least 0.

    Raises:
        ValueError: ``per_token`` < 1.
    """
    if per_token < 1:
        raise ValueError("per_token must be >= 1")
    return max(0, (budget - weights - activations) // per_token)


@dataclass(slots=True, frozen=True)
class MemoryPlan:
    """The engine's memory arithmetic at load (bytes unless noted; :mod:`pipeline.llm.memory`).

    Attributes:
        budget: weights + KV + activations allowed. source: where it came from.
        weights: the model's weights. activations: one full step's estimated peak
            (``max_prefill_tokens + max_batch_size`` new tokens).
        per_token: KV bytes per token. fit: KV tokens the budget holds after weights and
            activations. configured: ``SchedulerConfig.max_kv_tokens``. floor: one full
            request (``max_context_tokens + max_new_tokens``). kv_tokens: the KV token
            budget in force: ``min(configured, max(fit, floor))``.
    """

    budget: int
    source: str
    weights: int
    activations: int
    per_token: int
    fit: int
    configured: int
    floor: int
    kv_tokens: int

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of ``tokens`` KV-cache tokens over all layers: ``tokens × per_token`` (e.g.
        the batch's reservation, :attr:`~pipeline.serving.types.StageLoad.kv_reserved`)."""
        return tokens * self.per_token

    def kv_free(self, reserved: int) -> int:
        """KV-cache tokens of the budget (:attr:`kv_tokens`) left after ``reserved``, at least 0:
        what the prefix cache may keep beside the batch's reservations."""
        return max(0, self.kv_tokens - reserved)

    def request_bytes(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """KV bytes a request may hold: (prompt + max new tokens) × :attr:`per_token`.

        Raises:
            ValueError: a negative token count.
        """
        return _request_bytes(self.per_token, prompt_tokens, max_new_tokens)


def plan(runner: ModelRunner, config, cfg: LlmConfig, sched: SchedulerConfig) -> MemoryPlan:
    """Derive the KV token budget from the memory budget and log it (one line)."""
    elt = runner.kv_dtype_bytes
    per_token = kv_bytes_per_token(config, elt)
    weights = runner.weight_bytes
    free = None if cfg.memory_budget_mb > 0 else runner.device_free_bytes()
    if cfg.memory_budget_mb > 0:
        source = "--memory-budget"
    elif free is not None:
        source = f"weights + CUDA free × {GPU_MEMORY_FRACTION}"
    else:
        source = f"weights + available RAM × {CPU_MEMORY_FRACTION}"
    budget = budget_bytes(weights=weights, memory_budget_mb=cfg.memory_budget_mb, device_free=free)
    # the biggest step: one token per decoding row + a full prefill budget, rounded up to the
    # runner's bucket; a chunk's scores are bounded by max_prefill_attention, a decoding row's
    # by one full request; logits for every decoding row and every chunk
    tokens = sched.max_prefill_tokens + sched.max_batch_size + runner.BUCKET
    floor = cfg.max_context_tokens + cfg.max_new_tokens
    attended = max(-(-sched.max_prefill_attention // sched.max_prefill_tokens), floor)
    acts = activation_bytes(config, elt, tokens, attended=attended, logits_rows=2 * sched.max_batch_size)
    fit = kv_token_budget(budget, weights, acts, per_token)
    plan = MemoryPlan(budget=budget, source=source, weights=weights, activations=acts, per_token=per_token, fit=fit,
                      configured=sched.max_kv_tokens, floor=floor,
                      kv_tokens=min(sched.max_kv_tokens, max(fit, floor)))
    mib = MIB
    logger.info("LLM memory: budget %.1f MiB (%s) − weights %.1f MiB − activations %.1f MiB → %d KV tokens at "
                "%d bytes/token; KV budget %d tokens (max_kv_tokens %d%s)", budget / mib, source, weights / mib,
                acts / mib, fit, per_token, plan.kv_tokens, sched.max_kv_tokens,
                f", raised to one full request of {floor}: over budget" if fit < floor <= sched.max_kv_tokens else "")
    return plan
