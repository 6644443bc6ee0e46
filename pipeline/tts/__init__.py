"""The TTS room: the pure phrase chunker, the Piper engine pool and its loader."""
