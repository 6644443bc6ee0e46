"""The OpenAI Realtime API subset at ``/v1/realtime``: a second wire format over the same
:class:`~pipeline.session.session.Session` (docs/REALTIME.md)."""
