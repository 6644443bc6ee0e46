"""Load the end-of-turn model explicitly: Smart Turn v3.2 from the ``pipecat-ai`` wheel
(``auto``) or a local ``.onnx`` file with the same input and output, checked before use.

The session options are pipecat's (``LocalSmartTurnAnalyzerV3``): sequential execution, one
inter-op thread, ``threads`` intra-op threads, every graph optimisation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from pipeline import model_files
from pipeline.eot.features import N_FRAMES, N_MELS
from pipeline.eot.types import EotModelInfo

INPUT_NAME = "input_features"
"""The model's input: float32, shape (batch, 80, 800), :func:`pipeline.eot.features.features`."""
OUTPUT_NAME = "logits"
"""The model's output: float32, shape (batch, 1); despite its name already the probability
(a sigmoid is inside the graph) that the turn is complete, as pipecat reads it."""


class EotModel:
    """An end-of-turn ONNX model, checked: one input ``input_features`` (batch, 80, 800)
    float32, one output ``logits`` (batch, 1). Call :meth:`predict` from one thread at a time
    (the stage's worker).

    Args:
        session: the onnxruntime session.
        info: where it came from.

    Raises:
        ValueError: the model's input or output is not the above.
    """

    def __init__(self, session: ort.InferenceSession, info: EotModelInfo) -> None:
        check_signature(session, info.path)
        self.session = session
        self.info = info

    def predict(self, feats: np.ndarray) -> np.ndarray:
        """Probabilities that each turn is complete.

        Args:
            feats: float32, shape (b, 80, 800), b >= 1.

        Returns:
            float32, shape (b,), each in 0..1.
        """
        out = self.session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(feats, dtype=np.float32)})[0]
        return np.asarray(out, dtype=np.float32).reshape(len(feats))


def check_signature(session: ort.InferenceSession, path: Path) -> None:
    """Check that ``session`` takes ``input_features`` float32 (batch, 80, 800) and gives
    ``logits`` float (batch, 1) (a dynamic or fixed batch dimension; ``path`` for the message).

    Raises:
        ValueError: it does not.
    """
    inputs, outputs = session.get_inputs(), session.get_outputs()
    want = (f"one input {INPUT_NAME!r} tensor(float) [batch, {N_MELS}, {N_FRAMES}] and one output "
            f"{OUTPUT_NAME!r} tensor(float) [batch, 1]")
    got = (f"inputs {[(i.name, i.type, i.shape) for i in inputs]}, "
           f"outputs {[(o.name, o.type, o.shape) for o in outputs]}")
    ok = (len(inputs) == 1 and len(outputs) == 1
          and inputs[0].name == INPUT_NAME and inputs[0].type == "tensor(float)"
          and list(inputs[0].shape)[1:] == [N_MELS, N_FRAMES] and len(inputs[0].shape) == 3
          and outputs[0].name == OUTPUT_NAME and outputs[0].type == "tensor(float)"
          and len(outputs[0].shape) == 2 and outputs[0].shape[1] == 1)
    if not ok:
        raise ValueError(f"{path} is not an end-of-turn model like Smart Turn v3.2: want {want}; got {got}")


def resolve_eot_model(name: str) -> Path:
    """The ``.onnx`` file ``--eot-model`` names: ``auto`` is Smart Turn v3.2 from the
    ``pipecat-ai`` wheel (:func:`pipeline.model_files.smart_turn_onnx`); anything else a local
    file.

    Raises:
        ModelNotInstalled: ``auto`` and ``pipecat-ai`` is missing (the message says
            ``pip install --no-deps pipecat-ai==1.14.0``).
        FileNotFoundError: the local file does not exist.
    """
    if name == "auto":
        return model_files.smart_turn_onnx()
    path = Path(name).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"end-of-turn model {name!r} not found: give a local .onnx file, or 'auto' for "
                                f"Smart Turn v3.2 (pip install {model_files.SMART_TURN_PIP})")
    return path


def load_eot_model(name: str = "auto", *, threads: int = 1) -> EotModel:
    """Load and check the end-of-turn model (slow-ish: call once, off the event loop).

    Args:
        name: ``auto`` or a local ``.onnx`` path (:func:`resolve_eot_model`).
        threads: onnxruntime intra-op threads (``--eot-threads``).

    Raises:
        ModelNotInstalled, FileNotFoundError: see :func:`resolve_eot_model`.
        ValueError: the file is not an ONNX model onnxruntime can load, or its input or
            output differs from Smart Turn v3.2's (:func:`check_signature`).
    """
    path = resolve_eot_model(name)
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.inter_op_num_threads = 1
    so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own classes (InvalidProtobuf, Fail, ...)
        raise ValueError(f"{path} is not an ONNX model onnxruntime can load: {exc}") from exc
    return EotModel(session, EotModelInfo(path=path, threads=threads))
