"""voxpipe's engine: typed events, sessions, ASR/LLM/TTS engines, batching and resilience."""
