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
