"""Incremental detokenization that never splits a character.

Decoding token by token breaks multi-byte characters (emoji, CJK) into U+FFFD. Like
vLLM's and text-generation-inference's incremental detokenizers, we decode a short
window of recent tokens and emit only the text that is complete; the concatenation of
all deltas equals ``tokenizer.decode(all_ids)``.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Feed token ids one at a time; get the newly completed text.

    Args:
        tokenizer: a Hugging Face tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # end of text already emitted, as an index into ids

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is split)."""
        self.ids.append(int(token_id))
        prefix_text = self.tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        new_text = self.tok.decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is left (a dangling partial character is dropped)."""
        prefix_text = self.tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        new_text = self.tok.decode(self.ids[self._prefix :], skip_special_tokens=True)
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :].replace("\ufffd", "")


class StopStrings:
    """Cut a streamed text at the first stop string, emitting no part of one.

    Text arrives in deltas; a stop string may be split across them. :meth:`feed` returns
    what is safe to send now: everything before a stop string once one is complete, and
    otherwise everything but the longest tail that could still grow into one (held back
    until the next delta or :meth:`flush`). Empty stop strings are ignored.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""  # the reply so far, cut at the stop string once found
        self.sent = 0  # characters of text already returned
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the text safe to emit (sets :attr:`stopped` at a stop string)."""
        if self.stopped:
            return ""
        self.text += delta
        hits = [p for p in (self.text.find(s, self.sent) for s in self.stops) if p != -1]
        if hits:
            self.stopped, self.text = True, self.text[: min(hits)]
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held())

    def flush(self) -> str:
        """Generation ended: the held-back tail never became a stop string; return it."""
        return "" if self.stopped else self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the longest tail of the unsent text that begins some stop string."""
        tail = len(self.text) - self.sent
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, tail), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
