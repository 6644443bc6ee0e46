"""The LLM engine's output processor: sampled tokens become text on the requests' streams.

Each request in the scheduler has a :class:`RequestState`: its
:class:`~pipeline.llm.stream.TokenStream`, an :class:`~pipeline.llm.detok.IncrementalDetokenizer`
and its :class:`~pipeline.llm.detok.StopStrings`. Each step's sampled tokens are detokenized
into exact text deltas (no split character, no part of a stop string) and put on the
streams; a finished request's stream is closed with the held-back text, its time per
output token and its finish reason. The shape of vLLM v1's ``OutputProcessor``
(vllm/v1/engine/output_processor.py): a request that a stop string ends is handed back to
the engine core to finish in the scheduler. Engine thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pipeline.llm.detok import IncrementalDetokenizer, StopStrings
from pipeline.llm.stream import TokenStream
from pipeline.llm.types import FinishReason, SchedRequest, State


@dataclass(slots=True)
class RequestState:
    """A request in the scheduler as the output side sees it: its stream and text pipeline.

    Attributes:
        t_first: ``time.perf_counter()`` at its first token (s; None before it).
    """

    stream: TokenStream
    detok: IncrementalDetokenizer
    stops: StopStrings
    t_first: float | None = None
    prefix: str = ""

    def count_token(self, req: SchedRequest, tok: int | None, now: float) -> None:
        """Update ``ttft_ms`` (at the first token: ``now`` − submission, ms) and
        ``output_tokens`` (an end-of-sequence token, ``tok`` None, counts)."""
        st = self.stream.stats
        if self.t_first is None:
            self.t_first = now
            st.ttft_ms = (now - self.stream.submitted) * 1000
        st.output_tokens = len(req.output_ids) + (1 if tok is None else 0)

    def emit_text(self, tok: int) -> bool:
        """Detokenize ``tok`` and put the text that is safe to send on the stream; True
        when a stop string has ended the reply."""
        delta = self.detok.add(tok)
        if not delta:
            return False
        delta = self.stops.feed(delta)
        if self.prefix:  # the forced start of the reply goes out with its first text
            delta, self.prefix = self.prefix + delta, ""
        if delta:
            self.stream.put(delta)
        return self.stops.stopped


def end_stream(stream: TokenStream, reason: FinishReason, error: BaseException | None = None) -> None:
    """Set the finish reason, then end the stream (with ``error`` for the consumer)."""
    stream.stats.finish_reason = reason
    stream.end(error)


class OutputProcessor:
    """The output side of every request in the scheduler, by request id.

    Args:
        tokenizer: the Hugging Face tokenizer the detokenizers decode with.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.live: dict[int, RequestState] = {}

    def add(self, req: SchedRequest, stream: TokenStream, stop: list[str], prefix: str = "") -> None:
        """Follow ``req`` (its prompt counted in ``stream.stats.prompt_tokens``); ``stop``:
        the strings that end its reply; ``prefix``: text prefilled as the reply's start (a
        forced tool call), put on the stream ahead of its first text."""
        stream.stats.prompt_tokens = len(req.prompt_ids)
        self.live[req.rid] = RequestState(stream, IncrementalDetokenizer(self.tokenizer), StopStrings(stop),
                                          prefix=prefix)

    def stream_of(self, rid: int) -> TokenStream | None:
        """The stream of request ``rid`` (None: not followed, or closed)."""
        state = self.live.get(rid)
        return None if state is None else state.stream

    def aborted(self) -> list[int]:
        """Ids of the followed requests whose stream was aborted."""
        return [rid for rid, state in list(self.live.items()) if state.stream.aborted.is_set()]

    def process_outputs(self, sampled: list[tuple[SchedRequest, int | None]]) -> list[int]:
        """Turn each sampled token (None: end of sequence) into text on its stream; close
        the requests the scheduler finished (length, EOS).

        Returns:
            ids of the requests a stop string ended: still open; the engine finishes them
            in the scheduler, then closes them (``flush=False``: the text is complete).
        """
        now = time.perf_counter()
        stopped: list[int] = []
        for req, tok in sampled:
            state = self.live.get(req.rid)
            if state is None:
                continue
            state.count_token(req, tok, now)
            if tok is not None and state.emit_text(tok):
                stopped.append(req.rid)
            elif req.state is State.FINISHED:
                self.close(req.rid, req.finish_reason or FinishReason.STOP)
        return stopped

    def close(self, rid: int, reason: FinishReason, *, flush: bool = True) -> None:
        """End a followed request's stream: the held-back text first (unless aborted or
        ``flush`` is False), then ``tpot_ms`` (ms per output token after the first) and the
        finish reason. Unknown ids are ignored."""
        state = self.live.pop(rid, None)
        if state is None:
            return
        if flush and reason is not FinishReason.ABORT:
            tail = state.prefix + state.stops.feed(state.detok.flush()) + state.stops.flush()
            if tail:
                state.stream.put(tail)
        st = state.stream.stats
        if state.t_first is not None and st.output_tokens > 1:
            st.tpot_ms = (time.perf_counter() - state.t_first) * 1000 / (st.output_tokens - 1)
        end_stream(state.stream, reason)

    def fail(self, rid: int, exc: BaseException) -> None:
        """End request ``rid``'s stream with ``exc`` (finish reason ``error``; no held-back
        text, no ``tpot_ms``). Unknown ids are ignored."""
        state = self.live.pop(rid, None)
        if state is not None:
            end_stream(state.stream, FinishReason.ERROR, exc)
