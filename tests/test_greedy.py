"""Greedy decoding's argmax (pipeline/llm/runner/greedy.py, native/argmax.c): torch.argmax's answer on
the same fp32 values for any bf16 logits (ties, NaN, -inf, tails, strided rows), and PyTorch's
argmax where the kernel does not apply."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.llm.runner import greedy

SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0]


def _expected(x: torch.Tensor) -> list[int]:
    return torch.argmax(x.float(), dim=-1).tolist()


@pytest.mark.native
@given(rows=st.integers(1, 9), n=st.integers(1, 200), seed=st.integers(0, 10_000),
       levels=st.integers(1, 6), specials=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(SPECIAL)),
                                                    max_size=6))
@settings(max_examples=200, deadline=None)
def test_the_kernel_gives_torch_argmax_on_any_logits(rows, n, seed, levels, specials):
    g = torch.Generator().manual_seed(seed)
    # few distinct values: ties everywhere, within a vector and across its lanes and the tail
    x = torch.randint(0, levels, (rows, n), generator=g).float().to(torch.bfloat16)
    for at, v in specials:
        x.view(-1)[at % x.numel()] = v
    assert greedy.argmax(x) == _expected(x)


@pytest.mark.native
def test_a_real_vocabulary_row_by_row_and_in_a_strided_view(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 151936, generator=g).to(torch.bfloat16)
    x[3, 151935] = 50.0  # the last column (the last vector's last lane)
    x[5, 7] = x[5, 150_000] = 60.0  # a tie far apart: the first wins
    x[6].fill_(float("-inf"))
    x[7, 99_999] = float("nan")
    wide = torch.randn(4, 300, generator=g).to(torch.bfloat16)
    view = wide[:, 10:250]  # rows 300 apart, 240 columns
    expected, expected_view = _expected(x), _expected(view)

    def not_pytorch(*args, **kwargs):
        raise AssertionError("bf16 CPU logits must take the kernel")

    monkeypatch.setattr(torch, "argmax", not_pytorch)
    assert greedy.argmax(x) == expected
    assert view.stride() == (300, 1) and greedy.argmax(view) == expected_view


def test_other_dtypes_devices_and_layouts_take_pytorchs_argmax():
    x = torch.randn(3, 50)
    assert greedy.argmax(x) == _expected(x)
    assert greedy.argmax(x.to(torch.float16)) == _expected(x.to(torch.float16))
    t = x.to(torch.bfloat16).t()  # last dimension not contiguous
    assert greedy.argmax(t) == _expected(t)
    assert greedy.argmax(torch.empty(0, 10, dtype=torch.bfloat16)) == []
    b = torch.randn(3, 40).to(torch.bfloat16)
    negated = torch._neg_view(b)  # a lazy negation: its memory holds b's values
    assert negated.is_neg() and greedy.argmax(negated) == _expected(negated) != _expected(b)


def test_logits_without_a_vocabulary_are_refused():
    with pytest.raises(ValueError, match="rows, vocab"):
        greedy.argmax(torch.zeros(4, 0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rows, vocab"):
        greedy.argmax(torch.zeros(5, dtype=torch.bfloat16))
