"""The WebRTC edge: ``POST /webrtc/offer`` answers a browser's (or any WebRTC stack's) offer
with one voxpipe session behind a peer connection — Opus audio both ways on one track, the
protocol's JSON events on a data channel named ``events`` (docs/PROTOCOL.md, "WebRTC")."""
