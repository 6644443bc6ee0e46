"""Bound onnxruntime's CPU memory under Piper across a long run (issue 37).

Piper's voice model takes inputs of every length. With onnxruntime's defaults the session
plans a memory pattern per input shape and serves it from a growing CPU arena (a BFC arena:
it keeps what it grew, in chunks that each new size may not fit), so a server speaking all
day kept growing in steps: in one process, 200 random sentences of 3-30 words took the
anonymous memory from 105 MB to 326 MB after 20 and 368 MB after 200, still climbing. The
memory pattern off (``SessionOptions.enable_mem_pattern``) held it at 308-318 MB, and the
arena also shrunk at the end of each run (the run option
``memory.enable_memory_arena_shrinkage``, onnxruntime's
``kOrtRunOptionsConfigEnableMemoryArenaShrinkage``) at 175 MB from the 20th sentence to the
200th. The pattern costs nothing measurable; shrinking after every run cost about 10 % of
synthesis time, so voxpipe shrinks once the TTS stage goes idle (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Any

SHRINK_KEY = "memory.enable_memory_arena_shrinkage"
"""onnxruntime's run-config key: the arenas named in its value ("cpu:0") give back their free
chunks when the run ends (onnxruntime/core/session/onnxruntime_run_options_config_keys.h)."""


def bounded_options(options: Any) -> Any:
    """``options`` (an ``onnxruntime.SessionOptions``) with no memory pattern per input shape;
    returned for chaining."""
    options.enable_mem_pattern = False
    return options


class ShrinkingSession:
    """An ``onnxruntime.InferenceSession`` whose next :meth:`run` after :meth:`shrink_next`
    ends by shrinking the CPU arena; everything else is the session's own (attribute access
    falls through).

    Shrinking after every run held the memory lowest but cost about 10 % of synthesis time
    (each run grows the arena afresh), so the TTS stage shrinks once per idle spell
    (:meth:`pipeline.tts.engine.TtsEngine.on_idle`): between replies, not between phrases.

    Args:
        session: the ``onnxruntime.InferenceSession`` to wrap.
    """

    def __init__(self, session: Any) -> None:
        import onnxruntime

        self._session = session
        self._shrink = onnxruntime.RunOptions()
        self._shrink.add_run_config_entry(SHRINK_KEY, "cpu:0")
        self._pending = False

    def shrink_next(self) -> None:
        """Make the next :meth:`run` (any thread's) shrink the arena when it ends."""
        self._pending = True

    def run(self, output_names: Any, input_feed: dict[str, Any], run_options: Any = None) -> list[Any]:
        """``InferenceSession.run``; after :meth:`shrink_next`, with the shrink entry (added
        to a caller's own ``run_options``)."""
        if self._pending:
            self._pending = False
            if run_options is None:
                run_options = self._shrink
            else:
                run_options.add_run_config_entry(SHRINK_KEY, "cpu:0")
        return self._session.run(output_names, input_feed, run_options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)
