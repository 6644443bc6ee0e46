"""Quality guard of the int4 decode path (issue 16): on a spread of the fixed prompt set, the
int4 model's perplexity of the bf16 model's greedy replies stays within a bound of bf16's
own, and most greedy replies stay identical. A kernel or quantization change that breaks
quality fails here; bench/llm_quant.py prints the full table."""

from __future__ import annotations

import pytest

from bench.llm_quant import quality
from bench.prompts import load_prompts

pytestmark = pytest.mark.slow

PPL_RATIO_BOUND = 1.05
"""Issue 16's bound on perplexity(int4) / perplexity(bf16) of bf16-generated text. Pinned on
the ratio, not on identical first-32-token replies (≥ 90 % was the alternative): measured on
the whole set, SmolLM2 int4 keeps 67 % of the replies identical (mean common prefix 27 of 32
tokens) at a ratio of 1.001; Qwen2.5-0.5B, whose GGUF layers are 5-bit (Q5_0), keeps none
identical (mean prefix 15) at 1.035, and even int8 keeps only 39-75 %: greedy replies fork
on near-ties under any change of rounding, so identity would measure ties, not quality. An
int4 LM head on SmolLM2 (1.066) fails the bound."""

MEAN_PREFIX_FLOOR = 12
"""Fewest greedy tokens (of 32, mean over the prompts) int4 must share with bf16's reply
before it forks. Measured on these 8 prompts: 17.88 with the prompts prefilled in bf16,
14.88 with every step in int4 (``greedy`` runs the prefill quantized, as the server does
without AMX); with every int4 weight off by 5 % (scales and mins × 1.05) it is 4.5, by 20 %
1.75."""


def test_int4_smollm2_stays_within_the_perplexity_bound_of_bf16():
    prompts = [p.text for p in load_prompts()][::6]  # 8 prompts: statements, questions, clips
    bf16, int4 = quality("smollm2", ["cpu-int4"], prompts, 32, threads=1)
    assert bf16.device == "cpu" and bf16.ppl_ratio == 1.0 and int4.device == "cpu-int4"
    assert int4.ppl_ratio <= PPL_RATIO_BOUND, int4
    assert int4.mean_prefix >= MEAN_PREFIX_FLOOR, int4  # the replies start the same way
