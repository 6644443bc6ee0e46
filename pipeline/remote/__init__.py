"""voxpipe's model stages as Ray Serve deployments (``voxpipe serve --ray auto|ADDRESS``).

The session logic (VAD, endpointing, turns, barge-in, history) stays in the WebSocket front
end; ASR, LLM and TTS run in Serve replicas (:mod:`pipeline.remote.replicas`), each with the
same batching engine the in-process server runs. The front end reaches them through client
classes (:mod:`pipeline.remote.clients`) that implement the stage interfaces of
:mod:`pipeline.stages`, so a :class:`~pipeline.session.session.Session` cannot tell them
from in-process engines. :mod:`pipeline.remote.app` builds the Serve application (also the
import path of ``deploy/ray-serve.yaml``); :mod:`pipeline.remote.connect` joins a cluster,
deploys it and hands back :class:`~pipeline.engines.Engines`.

Every module here but :mod:`pipeline.remote.types` and :mod:`pipeline.remote.settings`
imports ``ray``: install the ``ray`` extra (``pip install -e ".[ray]"``).
"""
