"""The end-of-turn room: Smart Turn v3.2 (an audio classifier: has the user finished their
turn?) — its input features (features.py), the explicit ONNX loader (loader.py) and the
batched stage every session shares (stage.py), which implements
:class:`pipeline.stages.EotStage`."""
