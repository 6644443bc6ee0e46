"""Typed configuration of turn-taking: VAD endpointing, the semantic end of turn, the merge
window, barge-in, backchannels and false-interruption resume. Part of
:class:`pipeline.config.VoxpipeConfig`, which re-exports it; fields are declared as there
(:mod:`pipeline.config_fields`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config_fields import check_ranges, flag

END_OF_TURN = ("silence", "smart-turn")
"""The end-of-turn rules (:attr:`TurnConfig.end_of_turn`)."""
EAGERNESS = ("auto", "low", "medium", "high")
"""The eagerness settings (:attr:`TurnConfig.eagerness`; OpenAI Realtime's ``semantic_vad``
names)."""


@dataclass(slots=True, kw_only=True)
class TurnConfig:
    """VAD turn detection (endpointing)."""

    threshold: float = flag(0.5, name="--vad-threshold")
    """Silero speech probability that starts speech; the default is Silero's."""
    neg_threshold: float = flag(0.35, name="--vad-neg-threshold")
    """Probability under which a window counts as silence (``threshold`` − 0.15, as in
    faster-whisper's ``VadOptions``)."""
    min_speech_ms: int = 250
    """Speech shorter than this is dropped as a click or cough (ms)."""
    end_silence_ms: int = 500
    """Silence that ends a turn (ms)."""
    early_end_ms: int = 200
    """Silence after which the final transcript and the reply start speculatively, held until
    the turn ends (ms; 0: off).

    Nothing of it reaches the client until the turn really ends (``end_silence_ms`` or
    ``input.end``); speech that resumes first discards it. Voice-to-voice latency drops by up
    to the difference."""
    pad_ms: int = 200
    """Audio kept before speech start and after speech end (ms)."""
    max_turn_s: float = 120.0
    """A turn is cut at this length (s).

    Streaming ASR keeps its own buffer under Whisper's 30 s window, so turns may be longer."""
    merge_window_ms: int = 2000
    """Speech that resumes within this long after a turn ended continues that turn (ms).

    Its reply is cancelled and its transcript goes on from the words already committed, so a
    pause mid-thought gets one reply."""
    barge_in_min_ms: int = 400
    """Speech over a reply must last this long and contain words (a partial transcript) to
    cancel the reply (ms)."""
    vad_gate: bool = True
    """Quiet windows after half a second of non-speech skip Silero, so a silent session costs
    almost nothing (:mod:`audio.vad_gate`)."""
    end_of_turn: str = "silence"
    """How a turn's end is decided: ``silence`` (``end_silence_ms`` of silence) or
    ``smart-turn`` (the Smart Turn v3.2 end-of-turn model on the turn's audio, asked early in
    each silence: a confident "complete" ends the turn at
    once, "incomplete" waits up to the eagerness's cap; :mod:`pipeline.session.end_of_turn`)."""
    eagerness: str = "auto"
    """How soon ``smart-turn`` ends a turn: ``low`` (waits longest for the user to go on),
    ``medium``, ``high`` (answers soonest) or ``auto`` (``medium``). A session may choose its
    own in ``session.start`` (``eagerness``) or Realtime's ``semantic_vad``."""
    eot_model: str = flag("auto", metavar="PATH")
    """The end-of-turn ONNX model: ``auto`` (Smart Turn v3.2, from the ``pipecat-ai`` wheel)
    or a local ``.onnx`` file with the same input and output."""
    eot_batch_size: int = 1
    """Most end-of-turn requests (from any sessions) the model runs together.

    1 by default: on a few CPU cores a batch costs as much per request as calls one by one,
    and every request in it waits for the whole batch (``voxpipe bench eot``,
    docs/BENCHMARKS.md); raise it with ``eot_threads`` on a machine with cores to spare."""
    eot_threads: int = 1
    """CPU threads for the end-of-turn model (onnxruntime intra-op threads)."""
    eot_timeout_ms: int = 400
    """Longest wait for the end-of-turn model's answer (ms); past it the silence rule decides,
    as when the model is busy (the session's audio waits meanwhile)."""
    backchannels: bool = True
    """While the assistant speaks, a short acknowledgement ("yeah", "mm-hm", "okay": the
    language's word list in :mod:`pipeline.session.backchannel`, within
    ``backchannel_max_ms`` and ``backchannel_max_words``) does not cancel the reply."""
    backchannel_words: str = ""
    """More backchannel words or phrases, comma-separated, for every language (added to the
    built-in lists)."""
    backchannel_max_ms: int = 1000
    """Speech over a reply longer than this is never a backchannel (ms)."""
    backchannel_max_words: int = 3
    """Speech over a reply with more words than this is never a backchannel."""
    resume_after_ms: int = 1000
    """False-interruption resume: speech over a reply first pauses it (its audio stops, the
    rest is kept); if no words (or only a backchannel) are heard within this long, or the
    speech ends without them, the reply resumes where it stopped; only words cancel it (ms;
    0: off, the reply plays on until words cancel it)."""

    def validate(self) -> None:
        """Raises:
            ValueError: thresholds out of order, or a duration out of range."""
        if not 0.0 < self.neg_threshold < self.threshold < 1.0:
            raise ValueError("turn: need 0 < neg_threshold < threshold < 1")
        if self.end_silence_ms < 100 or self.min_speech_ms < 0 or self.pad_ms < 0:
            raise ValueError("turn: end_silence_ms >= 100, min_speech_ms >= 0, pad_ms >= 0")
        if not 0 <= self.early_end_ms < self.end_silence_ms:
            raise ValueError("turn: need 0 <= early_end_ms < end_silence_ms (0 turns speculation off)")
        if not 1.0 <= self.max_turn_s <= 3600.0:
            raise ValueError("turn: max_turn_s must be within 1..3600 s")
        if self.end_of_turn not in END_OF_TURN:
            raise ValueError(f"turn: end_of_turn must be one of {', '.join(END_OF_TURN)}, got {self.end_of_turn!r}")
        if self.eagerness not in EAGERNESS:
            raise ValueError(f"turn: eagerness must be one of {', '.join(EAGERNESS)}, got {self.eagerness!r}")
        check_ranges("turn", self, {"min_speech_ms": (0, 10_000), "end_silence_ms": (100, 60_000), "pad_ms": (0, 5_000),
                                    "merge_window_ms": (0, 60_000), "barge_in_min_ms": (0, 60_000),
                                    "eot_batch_size": (1, 256), "eot_threads": (1, 256), "eot_timeout_ms": (10, 60_000),
                                    "backchannel_max_ms": (0, 60_000), "backchannel_max_words": (0, 100),
                                    "resume_after_ms": (0, 60_000)})


__all__ = ["EAGERNESS", "END_OF_TURN", "TurnConfig"]
