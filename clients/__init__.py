"""Clients of the voxpipe WebSocket protocol: the Python client behind ``voxpipe ask``, and the microphone CLI."""
