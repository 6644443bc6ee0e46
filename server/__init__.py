"""The WebSocket server, the wire protocol, and the ``voxpipe`` command line."""
