"""The LLM room: types, the pure scheduler, the input processor (chat template, checks), the
output processor (detokenizer, stop strings, streams), memory plan, prefix cache keeper, step
stats, the continuous-batching engine core and its loader; every torch detail is fenced in runner/."""
