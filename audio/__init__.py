"""Pure audio utilities: PCM decoding, resampling, WAV I/O, VAD, device I/O."""
