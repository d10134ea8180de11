"""The tensor group's collectives and their backward, on T = 2 thread ranks: all_gather and
reduce_scatter are each other's adjoints, all_reduce its own; f and g are Megatron's."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.compiler.tensor.tp_harness import on_threads
from tpc.compiler.tensor import collectives as C
from tpc.compiler.tensor import thread_groups

T = 2


def _inputs(r):
    g = torch.Generator().manual_seed(10 + r)
    return torch.randn(4, 6, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_each_collective_passes_the_adjoint_gradient(op):
    """For a random cotangent w per rank, sum_r <op(x)_r, w_r> has gradient op^T(w) in x_r:
    checked against the gradient computed whole in one place from all ranks' inputs."""
    groups = thread_groups(T)
    xs = [_inputs(r).requires_grad_(True) for r in range(T)]
    out_rows = {"all_reduce": 4, "all_gather": 8, "reduce_scatter": 2}[op]
    ws = [torch.randn(out_rows, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + r))
          for r in range(T)]

    def run(r):
        fn = {"all_reduce": lambda x: C.all_reduce(x, groups[r]),
              "all_gather": lambda x: C.all_gather(x, 0, groups[r]),
              "reduce_scatter": lambda x: C.reduce_scatter(x, 0, groups[r])}[op]
        y = fn(xs[r])
        (y * ws[r]).sum().backward()
        return y.detach()

    ys = on_threads(T, run)
    # the same function written whole
    x = [t.detach().clone().requires_grad_(True) for t in xs]
    if op == "all_reduce":
        whole = [sum(x)] * T
    elif op == "all_gather":
        whole = [torch.cat(x, 0)] * T
    else:
        total = sum(x)
        whole = [total[r * 2:(r + 1) * 2] for r in range(T)]
    sum((w * y).sum() for w, y in zip(ws, whole)).backward()
    for r in range(T):
        torch.testing.assert_close(ys[r], whole[r].detach())
        torch.testing.assert_close(xs[r].grad, x[r].grad)


def test_f_and_g_are_megatrons():
    groups = thread_groups(T)
    xs = [_inputs(r).requires_grad_(True) for r in range(T)]

    def run(r):
        f = C.copy_to_region(xs[r], groups[r])
        assert torch.equal(f, xs[r])  # f: the identity forward
        y = C.reduce_from_region(f * (r + 1), groups[r])  # g: the sum forward
        y.sum().backward()  # g: the identity backward; f: the sum of the ranks' gradients backward
        return y.detach()

    ys = on_threads(T, run)
    torch.testing.assert_close(ys[0], xs[0].detach() * 1 + xs[1].detach() * 2)
    torch.testing.assert_close(ys[0], ys[1])
    for r in range(T):
        torch.testing.assert_close(xs[r].grad, torch.full_like(xs[r], 1.0 + 2.0))


def test_a_rank_that_never_arrives_breaks_the_barrier_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(C, "BARRIER_TIMEOUT_S", 0.2)
    groups = thread_groups(T)
    with pytest.raises(threading.BrokenBarrierError):
        groups[0].all_reduce(torch.ones(2))
