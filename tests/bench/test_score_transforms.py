"""bench/score_transforms.py's agreement check, at a tiny size on the CPU (FlexAttention's eager
forward, the one variant PyTorch runs here without compiling): FlexAttention with a soft-capping
`score_mod`, and with a sink folded in through the log-sum-exp, gives the written-out attention
tpc runs; a FlexAttention that computes something else is caught."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.bench.scripts import loaded


@pytest.fixture
def bench(monkeypatch):
    """The script as a module (`scripts.loaded`)."""
    yield from loaded(monkeypatch, "score_transforms.py")


def check(bench, case, flex):
    times = {("flex eager", "fwd"): 1.0}  # the variant that ran: eager, forward only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bench.exactness(case, {"flex eager": flex}, times, 1e-5)


@pytest.mark.parametrize("transform", ["softcap", "sink"])
def test_flex_agrees_with_the_written_out_attention_over_a_prefix(bench, transform):
    from torch.nn.attention.flex_attention import flex_attention

    case = bench.Case(transform, 8, 24, 2, 16, torch.float32, "cpu", 4.0)
    res = check(bench, case, lambda x: case.flex(flex_attention, x))
    assert res["variant"] == "flex eager, fwd" and res["exact"], res
    assert res["fwd a-b"] < 1e-5 and res["fwd b-f64"] < 1e-5, res
    # the transform matters at these scores: plain attention is far from it
    plain = case.sdpa(case.leaves(False))
    assert (plain - case.written_out(case.leaves(False))).abs().max() > 1e-2


@pytest.mark.parametrize("transform", ["softcap", "sink"])
def test_a_flex_that_computes_something_else_disagrees(bench, transform):
    from torch.nn.attention.flex_attention import flex_attention

    case = bench.Case(transform, 8, 24, 2, 16, torch.float32, "cpu", 4.0)
    other = bench.Case(transform, 8, 24, 2, 16, torch.float32, "cpu", 4.0)
    if transform == "softcap":
        other.softcap = 3.9  # a slightly different cap
    else:
        other.o = 23  # the causal mask one key off
    res = check(bench, case, lambda x: other.flex(flex_attention, x))
    assert not res["exact"] and res["fwd a-b"] > 1e-5, res


def test_the_gradient_comparison_covers_every_leaf(bench):
    """FlexAttention has no backward on the CPU, so the fwd+bwd comparison (what a GPU runs) is
    driven here with differentiable stand-ins for (b): the written-out form itself agrees to the
    bit, and one whose sink gradient is off by 1e-3 (the output unchanged) is caught."""
    case = bench.Case("sink", 8, 24, 2, 16, torch.float32, "cpu", 4.0)
    times = {("flex compiled", "fwd+bwd"): 1.0}
    same = bench.exactness(case, {"flex compiled": case.written_out}, times, 1e-5)
    assert same["variant"] == "flex compiled, fwd+bwd" and same["exact"], same
    assert same["fwd a-b"] == 0.0 and same["grad a-b"] == 0.0 and same["grad b-f64"] < 1e-5, same

    def sink_grad_off(x):
        s = x["sink"]
        return case.written_out({**x, "sink": s + 1e-3 * (s - s.detach())})

    off = bench.exactness(case, {"flex compiled": sink_grad_off}, times, 1e-5)
    assert off["fwd a-b"] == 0.0 and off["grad a-b"] > 1e-5 and not off["exact"], off


def reference_flex(q, k, v, score_mod=None, block_mask=None, scale=None, return_aux=None):
    """flex_attention's definition in plain differentiable torch (what its kernels compute):
    score_mod on the scaled scores, the block mask's mask_mod, softmax; lse on request."""
    lq, lk = q.size(-2), k.size(-2)
    s = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5 if scale is None else scale)
    b, h, i, j = (torch.arange(n).view(*([1] * a), n, *([1] * (3 - a))) for a, n in
                  enumerate((q.size(0), q.size(1), lq, lk)))
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    s = s.masked_fill(~block_mask.mask_mod(b, h, i, j), float("-inf"))
    out = torch.softmax(s, -1) @ v
    if return_aux is None:
        return out
    return out, type("Aux", (), {"lse": torch.logsumexp(s, -1)})()


@pytest.mark.parametrize("transform", ["softcap", "sink"])
def test_the_flex_construction_has_the_written_out_gradients(bench, transform):
    """The bench's (b) -- the score_mod, the mask_mod offset by the prefix, the sink through the
    log-sum-exp -- over flex_attention's definition in plain torch: its gradients (q, the prefix
    and own keys and values, the sink) are the written-out attention's, so on a GPU a
    disagreement is FlexAttention's kernels', not the construction's."""
    case = bench.Case(transform, 8, 24, 2, 16, torch.float32, "cpu", 4.0)
    times = {("flex compiled", "fwd+bwd"): 1.0}
    res = bench.exactness(case, {"flex compiled": lambda x: case.flex(reference_flex, x)}, times, 1e-5)
    assert res["exact"] and res["grad a-b"] < 1e-5 and res["grad b-f64"] < 1e-5, res
