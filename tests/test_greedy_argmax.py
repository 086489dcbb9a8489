"""Greedy sampling's native argmax (csrc/argmax.c) picks what torch.argmax picks:
the first maximum, the first NaN where a row has one, over vector bodies and
scalar tails."""

from __future__ import annotations

import pytest
import torch

from agentserve.runner import native
from agentserve.runner.sampler import greedy_ids

needs_lib = pytest.mark.skipif(native.layer_ops() is None, reason="native kernels unavailable")

INF, NAN = float("inf"), float("nan")


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3, 262144, generator=g)
    big[1, 200000] = 9.0
    big[2, 5] = big[2, 70000] = 9.0  # a tie: the first
    odd = torch.randn(4, 100, generator=g)
    odd[1, 40] = NAN
    odd[2, 99] = NAN  # in the scalar tail
    odd[3, 97] = 50.0
    return [big, odd, torch.zeros(2, 17), torch.full((1, 33), -INF), torch.tensor([[1.0, 3.0, 3.0, 2.0]]),
            torch.tensor([[1.0, NAN, 5.0, NAN]]), torch.tensor([[INF, 1.0, INF]]), torch.randn(5, 7, generator=g),
            torch.tensor([[-0.0, 0.0]]), torch.randn(2, 24, generator=g)]


@needs_lib
@pytest.mark.parametrize("i", range(len(_cases())))
def test_greedy_ids_equal_torch_argmax(i):
    x = _cases()[i]
    assert greedy_ids(x) == x.argmax(-1).tolist()


def test_other_dtypes_and_views_keep_their_answer():
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    assert greedy_ids(x.bfloat16()) == x.bfloat16().argmax(-1).tolist()
    t = x.t()  # not contiguous
    assert greedy_ids(t) == t.argmax(-1).tolist()
    assert greedy_ids(torch.empty(0, 5)) == []
