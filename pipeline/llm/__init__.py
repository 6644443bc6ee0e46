"""The LLM room: types, the pure scheduler, detokenizer, output stream, memory estimate,
the continuous-batching engine and its loader; every torch detail is fenced in runner/."""
