"""Batched Whisper decoding of streaming requests from many sessions (CTranslate2).

One call of :meth:`BatchDecoder.decode` takes the requests that the ASR worker collected
(from any sessions) and runs them as few model calls as possible:

1. log-Mel features per request, zero-padded to a **window** of ``audio + pad_s``
   rounded up to ``bucket_s`` (CTranslate2 accepts windows shorter than Whisper's 30 s;
   the encoder's cost is about linear in the window, so a 5 s buffer costs a sixth of a
   30 s window; at least ``pad_s`` = 3 s of padding keeps Whisper from looping at the
   end of the audio); a *final* decode of audio that fits the smallest window (under
   ``bucket_s`` − ``pad_s``: one word, "yeah", "stop") gets ``short_final_window_s``
   instead — Whisper, trained on 30 s windows, drops or repeats a lone word in a 5 s
   one (Piper-spoken one-word turns, bench in docs/BENCHMARKS.md: 22 of 60 right in a
   5 s window, 53 in 10 s, 60 in 15 s);
2. requests with the same window and the same ``<|startoftranscript|>`` position (a
   CTranslate2 constraint) form a group; the encoder runs per request on CPU (batched
   encodes were slower per item there: the activations leave the cache) or as one call
   on CUDA, and the group is decoded by one batched ``Whisper.generate`` — the call
   faster-whisper's ``BatchedInferencePipeline`` uses — with per-request prompts;
3. language detection (multilingual models, no language given) is one batched
   ``detect_language`` per group; word times, when asked for, one batched ``align``;
4. hallucination guards (:mod:`pipeline.asr.guards`) run on each continuation.

Each request's prompt is ``<|startofprev|>`` + the committed text before its audio
(the last ``prompt_tokens`` tokens), and its decoder prefix is the committed text inside
its audio, so the model only writes the continuation.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from audio.pcm import RATE
from pipeline.asr.agreement import join_words, split_words, word_spans
from pipeline.asr.guards import STOCK_NO_SPEECH, check_continuation, trailing_loop
from pipeline.asr.types import DecodeRequest, DecodeResult, TimedWord
from pipeline.config import AsrConfig
from pipeline.serving.ladder import is_oom

HOP = 160
"""Samples per feature frame (10 ms)."""
FRAMES_PER_S = RATE // HOP
MAX_FRAMES = 3000
"""Whisper's 30 s window in feature frames."""
TOKENS_PER_S = 10
"""Upper bound of tokens per second of speech (fast speech ≈ 6): a continuation that
reaches ``TOKENS_PER_S`` × audio seconds + 8 tokens is a runaway loop: the words before
the loop (and one copy of it) are kept when the decoder is sure there is speech, else
all of it is dropped."""








@dataclass(slots=True)
class _Item:
    index: int
    req: DecodeRequest
    frames: int
    prompt_ids: list[int]
    prefix_ids: list[int]
    language: str | None
    result: DecodeResult | None = None

    @property
    def done(self) -> DecodeResult:
        """The result, once :meth:`BatchDecoder._run_group` set it."""
        if self.result is None:
            raise RuntimeError("decode item has no result yet")
        return self.result
    full: str = ""  # prefix + kept continuation (what is aligned)


class BatchDecoder:
    """Runs :class:`DecodeRequest` batches on one faster-whisper ``WhisperModel``.

    Args:
        model: ``faster_whisper.WhisperModel`` (any size, English-only or multilingual).
        cfg: window, padding, prompt and guard settings (:class:`AsrConfig`).
    """

    def __init__(self, model, cfg: AsrConfig) -> None:
        from faster_whisper.tokenizer import Tokenizer

        self.model, self.cfg = model, cfg
        self.multilingual = bool(model.model.is_multilingual)
        self._tokenizers: dict[str | None, object] = {}
        self._base = Tokenizer(model.hf_tokenizer, self.multilingual, task="transcribe",
                               language="en" if self.multilingual else None)
        on_cuda = model.model.device == "cuda"
        self.encoder_batch = cfg.encoder_batch or (cfg.max_batch_size if on_cuda else 1)

    # ---- public ------------------------------------------------------------------

    def window_frames(self, n_samples: int, *, final: bool = False) -> int:
        """Encoder window (feature frames) for ``n_samples`` of audio: audio + ``pad_s``
        rounded up to ``bucket_s``, at most 3000 (30 s); a ``final`` decode whose window
        would be the smallest (one bucket) gets ``short_final_window_s`` instead."""
        need = n_samples / RATE + self.cfg.pad_s
        bucket = self.cfg.bucket_s
        window_s = math.ceil(need / bucket) * bucket
        if final and window_s <= bucket:
            window_s = max(window_s, self.cfg.short_final_window_s)
        return min(MAX_FRAMES, int(window_s * FRAMES_PER_S))

    def decode(self, reqs: list[DecodeRequest]) -> list[DecodeResult | BaseException]:
        """Decode ``reqs`` (any mix of sessions); one result or exception per request."""
        t0 = time.perf_counter()
        items = [self._item(i, r) for i, r in enumerate(reqs)]
        out: list[DecodeResult | BaseException] = [DecodeResult("", r.language or "en") for r in reqs]
        groups: dict[tuple[int, int], list[_Item]] = {}
        for it in items:
            if len(it.req.audio) < RATE // 10:  # < 100 ms: nothing to hear
                continue
            groups.setdefault((it.frames, len(it.prompt_ids)), []).append(it)
        for group in groups.values():
            try:
                self._run_group(group)
            except Exception as exc:
                if is_oom(exc):  # out of memory: the stage's ladder handles the whole batch
                    raise
                for it in group:
                    out[it.index] = exc
                continue
            for it in group:
                out[it.index] = it.done
        ms = (time.perf_counter() - t0) * 1000
        for res in out:
            if isinstance(res, DecodeResult):
                res.decode_ms = ms
        return out

    # ---- steps -------------------------------------------------------------------

    def tokenizer(self, language: str | None):
        """faster-whisper ``Tokenizer`` for ``language`` (cached)."""
        from faster_whisper.tokenizer import Tokenizer

        key = language if self.multilingual else None
        if key not in self._tokenizers:
            self._tokenizers[key] = Tokenizer(self.model.hf_tokenizer, self.multilingual, task="transcribe",
                                              language=key if self.multilingual else None)
        return self._tokenizers[key]

    def _item(self, i: int, req: DecodeRequest) -> _Item:
        tok = self._base
        prompt_ids: list[int] = []
        if req.prompt.strip() and self.cfg.prompt_tokens > 0:
            prompt_ids = [tok.sot_prev] + tok.encode(" " + req.prompt.strip())[-self.cfg.prompt_tokens :]
        prefix_ids = tok.encode(" " + req.prefix.strip()) if req.prefix.strip() else []
        language = req.language if self.multilingual else "en"
        return _Item(i, req, self.window_frames(len(req.audio), final=req.final), prompt_ids, prefix_ids, language)

    def _features(self, it: _Item) -> np.ndarray:
        feats = self.model.feature_extractor(it.req.audio.astype(np.float32, copy=False))[:, :-1]
        feats = feats[:, : it.frames]
        return np.pad(feats, ((0, 0), (0, it.frames - feats.shape[1])))

    def _encode(self, group: list[_Item]) -> np.ndarray:
        """Encoder outputs, float32 of shape (len(group), frames // 2, d_model)."""
        feats = [self._features(it) for it in group]
        outs = []
        for i in range(0, len(feats), self.encoder_batch):
            enc = self.model.encode(np.stack(feats[i : i + self.encoder_batch]))
            outs.append(_to_numpy(enc))
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    def _run_group(self, group: list[_Item]) -> None:
        import ctranslate2
        from faster_whisper.transcribe import get_suppressed_tokens

        enc_np = self._encode(group)
        enc = ctranslate2.StorageView.from_array(np.ascontiguousarray(enc_np))
        todo = [k for k, it in enumerate(group) if it.language is None]
        if todo:
            found = self.model.model.detect_language(enc)
            for k in todo:
                group[k].language = found[k][0][0][2:-2]
        prompts, max_len = [], 0
        for it in group:
            tok = self.tokenizer(it.language)
            prompt = it.prompt_ids + list(tok.sot_sequence) + [tok.no_timestamps] + it.prefix_ids
            prompts.append(prompt)
            # CTranslate2 stops a sequence (forced prefix included) at max_length // 2 tokens
            max_len = max(max_len, min(self.model.max_length, 2 * (len(it.prefix_ids) + _budget(it)) + 2))
        tok0 = self.tokenizer(group[0].language)
        results = self.model.model.generate(
            enc, prompts, beam_size=self.cfg.beam_size, max_length=max_len, return_scores=True,
            return_no_speech_prob=True, suppress_blank=True,
            suppress_tokens=list(get_suppressed_tokens(tok0, [-1])),
        )
        window_s = group[0].frames / FRAMES_PER_S
        for it, res in zip(group, results):
            ids = [t for t in res.sequences_ids[0] if t < tok0.eot]
            new_ids = ids[len(it.prefix_ids) :] if ids[: len(it.prefix_ids)] == it.prefix_ids else ids
            n_gen = max(1, len(res.sequences_ids[0]) - len(it.prefix_ids) + 1)
            avg_lp = res.scores[0] * len(res.sequences_ids[0]) / n_gen if res.scores else 0.0
            runaway = len(new_ids) >= _budget(it)
            text = self.tokenizer(it.language).decode(new_ids[: _budget(it)])  # the same alone or batched
            if runaway:  # a loop on silence ("I am a man who is a man who is …") keeps nothing
                sure = res.no_speech_prob <= STOCK_NO_SPEECH and avg_lp >= self.cfg.log_prob_threshold
                context = _join(it.req.prompt, it.req.prefix)
                text = _before_loop(text, sure=sure, context=context) if res.no_speech_prob <= STOCK_NO_SPEECH else ""
            kept, why = check_continuation(text, context=_join(it.req.prompt, it.req.prefix),
                                           no_speech_prob=res.no_speech_prob, avg_logprob=avg_lp,
                                           cfg=self.cfg, partial=not it.req.final)
            if runaway:
                why = "runaway"
            kept = join_words(split_words(kept))
            it.result = DecodeResult(kept, it.language or "en", None, float(res.no_speech_prob), float(avg_lp),
                                     why, window_s, len(group))
        self._align(group, enc_np)

    def _align(self, group: list[_Item], enc_np: np.ndarray) -> None:
        """Word times for the requests that asked (one batched align per language)."""
        import ctranslate2

        by_lang: dict[str, list[int]] = {}
        for k, it in enumerate(group):
            it.full = _join(it.req.prefix, it.done.text)
            if it.req.word_times and it.full:
                by_lang.setdefault(it.language or "en", []).append(k)
            elif it.req.word_times:
                it.done.words = []
        for lang, ks in by_lang.items():
            tok = self.tokenizer(lang)
            tokens = [tok.encode(" " + group[k].full) for k in ks]
            frames = [max(1, min(len(group[k].req.audio) // HOP, group[k].frames)) for k in ks]
            sv = ctranslate2.StorageView.from_array(np.ascontiguousarray(enc_np[ks]))
            aligned = self.model.find_alignment(tok, tokens, sv, frames)
            for k, words in zip(ks, aligned):
                group[k].done.words = _timed_words(group[k].full, words)


def _budget(it: _Item) -> int:
    """Most new tokens a request's audio can hold (see :data:`TOKENS_PER_S`)."""
    return int(TOKENS_PER_S * len(it.req.audio) / RATE) + 8


def _before_loop(text: str, *, sure: bool = False, context: str = "") -> str:
    """The words of a runaway continuation before the loop it ran into, and one copy of
    the loop ("of about 1455, 4555, 4555, …" → "of about 1455, 4555,"); "" when no loop
    shows. The loop may have begun in ``context`` (the committed words before the
    continuation): the copy kept then ends where its first copy ends. A loop from the
    start is noise ("小小小…") unless the decoder is ``sure`` (confident log-probability)
    and the loop is a phrase of at least :data:`MIN_SPOKEN_LOOP` words: Whisper repeats
    the last sentence of a buffer that ends right after it ("Captain Freer says that the
    scenery is delightful. Captain Freer says …"), and that sentence was said once. The
    last word may be cut short by the token budget: it is left out."""
    ctx = split_words(context)[-24:]
    words = split_words(text)[:-1]
    loop = trailing_loop([w.key for w in ctx] + [w.key for w in words])
    if loop is None or (loop[0] <= len(ctx) and not (sure and loop[1] >= MIN_SPOKEN_LOOP)):
        return ""
    return join_words(words[: max(0, sum(loop) - len(ctx))])


MIN_SPOKEN_LOOP = 3
"""Words in a loop from the start of a continuation that can be a repeated sentence."""


def _join(prefix: str, text: str) -> str:
    prefix, text = prefix.strip(), text.strip()
    return f"{prefix} {text}".strip()


def _timed_words(full: str, aligned: list[dict]) -> list[TimedWord]:
    """Map faster-whisper's aligned sub-words onto :func:`split_words` units of ``full``
    by character offsets (" " + full is the aligned text)."""
    spans, pos = [], -1  # aligned text carries one leading space
    for w in aligned:
        spans.append((pos, pos + len(w["word"]), float(w["start"]), float(w["end"])))
        pos += len(w["word"])
    out = []
    for word, a, b in word_spans(full):
        hits = [(s, e) for (ca, cb, s, e) in spans if ca < b and cb > a]
        if hits:
            out.append(TimedWord(word.text, min(h[0] for h in hits), max(h[1] for h in hits)))
        else:
            last = out[-1].end if out else 0.0
            out.append(TimedWord(word.text, last, last))
    return out


def _to_numpy(sv) -> np.ndarray:
    """A CTranslate2 StorageView as a float32 numpy array (copied off the GPU if needed)."""
    import ctranslate2

    if sv.device != "cpu":
        sv = sv.to_device(ctranslate2.Device.cpu)
    return np.array(sv, dtype=np.float32)
