"""Types of the end-of-turn room."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class EotStats:
    """What the end-of-turn stage has done since it was built (one consistent snapshot).

    Attributes:
        requests: requests the model answered (a failed batch's requests not counted).
        batches: model runs (each one ONNX call on a batch of requests).
        max_batch: the largest batch so far (0 before the first).
        last_batch: the size of the latest batch (0 before the first).
        refused: requests refused with :class:`~pipeline.errors.Busy` (the queue was full).
        busy_s: time spent computing features and running the model (s).
    """

    requests: int = 0
    batches: int = 0
    max_batch: int = 0
    last_batch: int = 0
    refused: int = 0
    busy_s: float = 0.0


@dataclass(slots=True, frozen=True)
class EotModelInfo:
    """A loaded end-of-turn model's identity.

    Attributes:
        path: the ``.onnx`` file.
        threads: onnxruntime intra-op threads.
    """

    path: Path
    threads: int
