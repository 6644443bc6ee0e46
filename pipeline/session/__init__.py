"""The session room: one conversation — its typed events, outbox, turn tracking (VAD,
endpointing, turn state), speculation, admission gate, replies, responder and history."""
