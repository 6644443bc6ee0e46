"""The WebSocket server: sessions over ``/ws``, their outbox, the wire protocol,
``/healthz``, ``/metrics`` and the web demo."""
