"""One session's streaming transcript: audio buffer + LocalAgreement + buffer trimming.

A pure synchronous state machine (no model, no I/O): :meth:`StreamingTranscript.request`
says what to decode, :meth:`StreamingTranscript.apply` takes the decoder's answer. The
async driver (:mod:`pipeline.asr.turn`) moves requests to the shared engine.

Work per update is bounded: once the buffer is longer than ``trim_s`` the decode also
asks for word times, and the buffer is cut between two committed words (preferably after
a sentence end), leaving the last ``SLACK_WORDS`` committed words in the buffer as the
forced prefix; the words before the cut become the decoding prompt. If nothing has been
agreed on by ``max_buffer_s``, the words that end at least ``KEEP_S`` before the end of
the buffer are committed and cut instead. So the buffer never reaches Whisper's 30 s
window and no words fall off its end (a 46 s utterance without a pause:
tests/test_asr_stream.py, tests/test_asr_server.py).

Audio that arrives faster than it is decoded (a burst, ``voxpipe ask --fast``) is worked
through the same way, never skipped: a request covers at most ``CATCHUP_WINDOW_S`` of the
buffer, or ``CATCHUP_STEP_S`` past the end of the last request if that is more, and the
driver decodes again at once while audio is left over. Decoding the buffer's first 27 s
instead lost words: Whisper without timestamps often stops after a sentence on a long
window, the word alignment then stretches that sentence over the whole window, and the
cut after it dropped the speech it never wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from audio.pcm import RATE
from pipeline.asr.agreement import LocalAgreement, Word, join_words, split_words
from pipeline.asr.types import DecodeRequest, DecodeResult, Partial, TimedWord
from pipeline.config import AsrConfig

KEEP_S = 2.0
"""Audio kept after a forced cut (s): the words still being spoken."""
MIN_TAIL_S = 0.5
"""A committed word ending closer than this to the end of the buffer is not a cut point (s)."""
SLACK_WORDS = 3
"""Committed words left in the buffer after a cut (they become the forced prefix). Word
times come from cross-attention alignment, which on tiny.en was off by up to a second
near the end of the committed text; cutting this many words earlier means such an error
only re-reads committed words and never cuts into words not yet committed."""
CATCHUP_WINDOW_S = 12.0
"""A request of a buffer that is behind covers at most this much of it (s), or
``CATCHUP_STEP_S`` past the last request's end if that is more (so a buffer with nothing
agreed on still grows to ``max_buffer_s`` and is force-cut there). At real-time pace a
buffer is cut near ``trim_s`` + one chunk, so every request covers the whole buffer."""
CATCHUP_STEP_S = 2.0
"""A request always reaches at least this far past the end of the last one (s)."""
_SENTENCE_END = (".", "?", "!", "。", "？", "！")




@dataclass(slots=True)
class _Pending:
    final: bool
    n_samples: int


class StreamingTranscript:
    """Streaming ASR state of one session (one turn, or turns merged into one).

    Args:
        cfg: ``min_chunk_ms``, ``trim_s``, ``max_buffer_s``, ``pad_s``.
        language: ISO code, or None to detect (locked once words are heard).
    """

    def __init__(self, cfg: AsrConfig, *, language: str | None = None) -> None:
        self.cfg = cfg
        self.language = language
        self.agreement = LocalAgreement()
        self._chunks: list[np.ndarray] = []
        self._n = 0  # samples in the buffer
        self._done = 0  # samples of the buffer covered by the last request
        self._k0 = 0  # committed words spoken before the buffer
        self._pending: _Pending | None = None
        self.trimmed_s = 0.0  # audio cut off the front of the buffer so far (s)

    # ---- audio -------------------------------------------------------------------

    def feed(self, samples: np.ndarray) -> None:
        """Append float32 16 kHz samples, shape (n,)."""
        if len(samples):
            self._chunks.append(samples.astype(np.float32, copy=False))
            self._n += len(samples)

    def drop_tail(self, n: int) -> None:
        """Remove the last ``n`` samples (silence after the end of speech)."""
        n = min(max(0, n), self._n)
        if n:
            buf = self._buffer()[: self._n - n]
            self._chunks, self._n = [buf], len(buf)
            self._done = min(self._done, self._n)

    def audio(self) -> np.ndarray | None:
        """All the audio fed so far (float32 16 kHz, shape (n,); less any :meth:`drop_tail`),
        or None once the front of the buffer was cut off (:meth:`_trim`): then no longer all."""
        return self._buffer().copy() if self.trimmed_s == 0 else None

    @property
    def buffer_s(self) -> float:
        """Audio in the buffer (s)."""
        return self._n / RATE

    @property
    def total_s(self) -> float:
        """Audio of the turn so far: cut off the front plus still buffered (s)."""
        return self.trimmed_s + self.buffer_s

    @property
    def decoded_s(self) -> float:
        """Audio of the turn up to the end of the last request (s)."""
        return self.trimmed_s + self._done / RATE

    @property
    def in_flight(self) -> bool:
        """True between :meth:`request` and :meth:`apply` / :meth:`cancel`."""
        return self._pending is not None

    def due(self) -> bool:
        """True when no request is in flight and the buffer holds ``min_chunk_ms`` of
        audio past the end of the last request (new audio, or audio still to catch up on)."""
        return self._pending is None and (self._n - self._done) * 1000 >= self.cfg.min_chunk_ms * RATE

    def fits_final(self) -> bool:
        """True when one request covers the whole buffer (else decode :meth:`request`
        until it does: the buffer is behind)."""
        return self._reach() >= self._n

    def _reach(self) -> int:
        """Samples of the buffer that the next non-final request covers."""
        window = int(CATCHUP_WINDOW_S * RATE)
        step = int(CATCHUP_STEP_S * RATE)
        return min(self._n, self._max_samples(), max(window, self._done + step))

    # ---- decoding ----------------------------------------------------------------

    def request(self, *, final: bool = False) -> DecodeRequest:
        """The next decode of the buffer; marks it in flight. A final request covers the
        whole buffer (at most 30 s − ``pad_s``: see :meth:`fits_final`), a partial one
        what :data:`CATCHUP_WINDOW_S` allows."""
        n = min(self._n, self._max_samples()) if final else self._reach()
        self._pending = _Pending(final, n)
        self._done = n
        return self._request(n, final=final)

    def _request(self, n: int, *, final: bool) -> DecodeRequest:
        committed = self.agreement.committed
        return DecodeRequest(
            audio=self._buffer()[:n],
            prefix=join_words(committed[self._k0 :]),
            prompt=join_words(committed[max(0, self._k0 - 64) : self._k0]),
            language=self.language,
            word_times=not final and n / RATE > self.cfg.trim_s,
            final=final,
        )

    def peek_request(self, *, drop_tail: int = 0) -> DecodeRequest:
        """A final decode of the buffer without its last ``drop_tail`` samples (the
        silence after the speech, as :meth:`drop_tail` would remove at the end of the
        turn), for a speculative final transcript: like ``request(final=True)`` but
        nothing is marked in flight; answer it with :meth:`preview` (changes nothing) or
        :meth:`commit_final`."""
        return self._request(min(max(0, self._n - drop_tail), self._max_samples()), final=True)

    def preview(self, result: DecodeResult, *, language: str | None = None) -> Partial:
        """The final transcript that ``result`` (the answer to :meth:`peek_request`)
        would give, without committing anything."""
        words = self.agreement.committed + [w for w in split_words(result.text) if w.key]
        text = join_words(words)
        return Partial(text, "", text, True, language or result.language or self.language or "en")

    def commit_final(self, req: DecodeRequest, result: DecodeResult) -> Partial:
        """Make ``result`` (the answer to :meth:`peek_request` ``req``) this turn's final
        transcript. Only valid if the buffer has not changed since: the caller made no
        other request meanwhile and fed nothing but the silence that :meth:`drop_tail` drops."""
        self._pending = _Pending(True, len(req.audio))
        return self.apply(result)

    def cancel(self) -> None:
        """The request in flight will not be answered (busy, failed, cancelled)."""
        self._pending = None

    def apply(self, result: DecodeResult) -> Partial:
        """Take the answer to the request in flight; returns the transcript so far."""
        p, self._pending = self._pending, None
        if p is None:
            raise RuntimeError("apply() without a request in flight")
        hyp = split_words(result.text)
        if p.final:
            self.agreement.flush(hyp)
        else:
            self.agreement.insert(hyp)
        if self.language is None and self.agreement.committed:
            self.language = result.language  # detected, and two hypotheses agreed in it
        if result.words is not None and not p.final:
            self._trim(p, result.words, silent=result.no_speech_prob > self.cfg.no_speech_threshold)
        return self.partial(final=p.final, language=result.language)

    def partial(self, *, final: bool = False, language: str | None = None) -> Partial:
        """The transcript as it stands."""
        a = self.agreement
        words = a.committed + a.tail
        return Partial(a.committed_text, a.tail_text, join_words(words), final,
                       language or self.language or "en")

    # ---- trimming ----------------------------------------------------------------

    def _trim(self, p: _Pending, words: list[TimedWord], *, silent: bool) -> None:
        """Cut the buffer after a committed word (see the module docstring). ``silent``:
        the decoder judged the buffer to hold no speech."""
        length = p.n_samples / RATE
        if length <= self.cfg.trim_s:
            return
        committed = self.agreement.committed
        n_in = len(committed) - self._k0  # committed words inside the buffer
        aligned = len(words) >= n_in and all(_k(w.text) == c.key for w, c in zip(words, committed[self._k0 :]))
        if aligned and not words and silent:  # no speech in the whole buffer: keep its end
            self._cut(length - KEEP_S, n_words=0)
            return
        cut = self._cut_index(words[: max(0, n_in - SLACK_WORDS)], length) if aligned else None
        if cut is None and length >= self.cfg.max_buffer_s:
            tail = words[n_in:] if aligned else []
            n_force = 0
            while n_force < min(len(tail), len(self.agreement.tail)) and tail[n_force].end <= length - KEEP_S:
                n_force += 1
            start = tail[0].start if tail else length - KEEP_S
            self.agreement.force(n_force)
            if aligned and n_in + n_force > SLACK_WORDS:  # (word times are only usable aligned)
                cut = n_in + n_force - 1 - SLACK_WORDS
            elif aligned and n_in == 0 and not tail and start >= 1.0:  # nothing said: keep the end
                self._cut(start - 0.3, n_words=0)
                return
            else:  # last resort, so that the buffer stays bounded: commit all, start afresh
                self.agreement.force(len(self.agreement.tail))
                self._cut(length, n_words=len(self.agreement.committed) - self._k0)
                return
        if cut is None:
            return
        end = words[cut].end
        nxt = words[cut + 1].start if cut + 1 < len(words) else min(length, end + 0.2)
        self._cut(max(end, (end + nxt) / 2), n_words=cut + 1)

    def _cut_index(self, committed: list[TimedWord], length: float) -> int | None:
        """Index of the committed word to cut after: the latest sentence end in the second
        half of the buffer, else the latest committed word (not too near the end)."""
        ok = [j for j, w in enumerate(committed) if w.end <= length - MIN_TAIL_S]
        if not ok:
            return None
        ends = [j for j in ok if committed[j].text.endswith(_SENTENCE_END) and committed[j].end >= length / 2]
        return (ends or ok)[-1]

    def _cut(self, t: float, *, n_words: int) -> None:
        n = min(self._n, int(t * RATE))
        buf = self._buffer()[n:]
        self._chunks, self._n = [buf], len(buf)
        self._k0 += n_words
        self._done = max(0, self._done - n)
        self.trimmed_s += n / RATE
        if n_words == 0:
            self.agreement.reset_tail()

    # ---- helpers -----------------------------------------------------------------

    def _max_samples(self) -> int:
        return int((30.0 - self.cfg.pad_s) * RATE)

    def _buffer(self) -> np.ndarray:
        if len(self._chunks) != 1:
            self._chunks = [np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)]
        return self._chunks[0]


def _k(text: str) -> str:
    return Word(text).key
