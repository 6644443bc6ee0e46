"""The LLM stage: one engine thread streams replies for every session.

Sessions :meth:`LlmEngine.submit` a :class:`GenRequest` and iterate the returned
:class:`TokenStream` for text deltas; :meth:`TokenStream.abort` (disconnect, cancel,
barge-in) stops its generation at the next token step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from .config import LlmConfig
from .detok import IncrementalDetokenizer
from .worker import Busy

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GenRequest:
    """A chat completion request.

    Attributes:
        messages: chat messages ``[{"role": ..., "content": ...}]`` (system first).
        max_new_tokens: most tokens to generate.
        temperature: 0 = greedy (default); >0 samples.
        top_p: nucleus sampling mass when sampling.
        stop: strings that end the reply (not included in it).
    """

    messages: list[dict]
    max_new_tokens: int = 96
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)


@dataclass(slots=True)
class GenStats:
    """Per-request measurements: ``ttft_ms`` (submit → first token), ``tpot_ms`` (mean
    time per output token after the first), ``prompt_tokens``, ``output_tokens``,
    ``finish_reason`` (``stop`` | ``length`` | ``abort`` | ``error``)."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""


class TokenStream:
    """Async iterator of text deltas for one request; ends when generation ends.

    Raises the engine's exception from ``__anext__`` if generation failed.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._q: asyncio.Queue = asyncio.Queue()
        self.aborted = threading.Event()
        self.stats = GenStats()
        self.submitted = time.perf_counter()

    def abort(self) -> None:
        """Stop generating at the next token step (thread-safe, idempotent)."""
        self.aborted.set()

    def _put(self, item) -> None:  # called from the engine thread
        self._loop.call_soon_threadsafe(self._q.put_nowait, item)

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> str:
        item = await self._q.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


class LlmEngine:
    """The process-wide LLM stage (one request decoded at a time).

    Args:
        llm: a :class:`pipeline.llm_loader.LoadedLLM`.
        cfg: queue size and defaults (see :class:`LlmConfig`).
    """

    def __init__(self, llm, cfg: LlmConfig) -> None:
        self.llm = llm
        self.cfg = cfg
        self.tokenizer = llm.tokenizer
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.queue_size)
        self._thread: threading.Thread | None = None
        self.active = 0
        eos = llm.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}

    @property
    def depth(self) -> int:
        """Requests waiting to start."""
        return self._queue.qsize()

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="voxpipe-llm", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread after the current request."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, req: GenRequest) -> TokenStream:
        """Queue a request; returns its stream of text deltas.

        Raises:
            Busy: the queue is full.
        """
        stream = TokenStream(asyncio.get_running_loop())
        try:
            self._queue.put_nowait((req, stream))
        except queue.Full:
            raise Busy(f"llm is busy: {self._queue.maxsize} requests already queued") from None
        return stream

    def count_tokens(self, messages: list[dict]) -> int:
        """Prompt tokens of ``messages`` under the model's chat template."""
        return len(self._prompt_ids(messages))

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(enc, dict) or hasattr(enc, "keys"):
            enc = enc["input_ids"]
        return list(enc)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            req, stream = job
            if stream.aborted.is_set():
                stream.stats.finish_reason = "abort"
                stream._put(None)
                continue
            self.active = 1
            try:
                self.generate(req, stream)
                stream._put(None)
            except Exception as exc:  # noqa: BLE001 - reported to this request only
                logger.exception("llm request failed")
                stream.stats.finish_reason = "error"
                stream._put(exc)
            finally:
                self.active = 0

    def generate(self, req: GenRequest, stream: TokenStream) -> None:
        """Decode one request token by token, pushing deltas to ``stream`` (engine thread)."""
        import torch
        from transformers import DynamicCache

        model, dev = self.llm.model, self.llm.device
        ids = self._prompt_ids(req.messages)
        stream.stats.prompt_tokens = len(ids)
        detok = IncrementalDetokenizer(self.tokenizer)
        text = ""
        gen = torch.Generator(device="cpu").manual_seed(0)
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            inp = torch.tensor([ids], device=dev)
            t_first = None
            for step in range(req.max_new_tokens):
                if stream.aborted.is_set():
                    stream.stats.finish_reason = "abort"
                    return
                logits = model(input_ids=inp, cache=cache, use_cache=True).logits[0, -1].float()
                tok = sample(logits, req.temperature, req.top_p, gen)
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                    stream.stats.ttft_ms = (now - stream.submitted) * 1000
                stream.stats.output_tokens = step + 1
                if tok in self.eos_ids:
                    stream.stats.finish_reason = "stop"
                    break
                delta = detok.add(tok)
                if delta:
                    text, delta, stopped = apply_stop(text, delta, req.stop)
                    if delta:
                        stream._put(delta)
                    if stopped:
                        stream.stats.finish_reason = "stop"
                        break
                inp = torch.tensor([[tok]], device=dev)
            else:
                stream.stats.finish_reason = "length"
            tail = detok.flush()
            if tail and stream.stats.finish_reason != "stop":
                stream._put(tail)
            if t_first is not None and stream.stats.output_tokens > 1:
                stream.stats.tpot_ms = (time.perf_counter() - t_first) * 1000 / (stream.stats.output_tokens - 1)


def sample(logits, temperature: float, top_p: float, gen) -> int:
    """Pick the next token from logits (float32, shape (vocab,)): greedy when
    ``temperature`` is 0, else temperature + nucleus (top-p) sampling (Holtzman et al. 2020)."""
    import torch

    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        sorted_p = sorted_p * keep
        return int(idx[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def apply_stop(text: str, delta: str, stops: list[str]) -> tuple[str, str, bool]:
    """Append ``delta`` to ``text`` and cut at the first stop string.

    Returns (new text, delta to emit, stopped). A stop string split across deltas is
    found because the search covers the end of the previous text.
    """
    new = text + delta
    for s in stops:
        pos = new.find(s, max(0, len(text) - len(s) + 1))
        if s and pos != -1:
            return new[:pos], new[len(text) : pos] if pos > len(text) else "", True
    return new, delta, False
