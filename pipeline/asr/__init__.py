"""The ASR room: Whisper (faster-whisper) streaming transcription — types, LocalAgreement
(agreement.py), guards, the per-session stream and turn driver, batched decoding, the
engine and its loader."""
