"""The stage runtime (tpc.executors.stage_runtime.StageRuntime) on its own, against plain autograd
on the unsliced stage (one call of the `StageModule` on the whole sequence, empty cache):

- forward slice by slice, each reading the keys/values (or carried inputs) of the earlier slices
  of its micro-batch from the runtime's cache, then backward in reverse slice order, gives the
  unsliced activation (or loss), input gradient and parameter gradients (relative error <= 1e-5),
  on the first, a middle, the last and a whole-model stage; with the cache sized once from the
  micro-batch's length and grown by doubling; for attention (GPT, Llama) and for a windowed
  carried state (a causal convolution of kernel 7);
- backward_input then backward_weight (per slice, or every weight half at the end) equals backward;
- the order rules: a slice's forward needs the earlier slices', its backward the later slice's;
- micro-batches have caches of their own, and `free_kv` drops one micro-batch's only;
- a checkpointed forward keeps no graph until `recompute`; `evaluate` keeps none at all.

The models are tests/executors/models/tiny_*.py, traced once (tests/executors/real.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.executors.real import fresh_model
from tpc.executors.oracle import gradient_error, relative_error
from tpc.compiler.programs.stage_programs import StagePrograms
from tpc.executors.stage_runtime import StageRuntime

SEQ, B = 16, 2
LENS = (5, 1, 7, 3)  # uneven, one of a single token
TOL = 1e-5
WHERE = ("first", "middle", "last", "whole")


def stage_of(name: str, where: str):
    """A stage of tiny_NAME.py with parameters of its own (a fresh copy of the seed-0 weights)."""
    model, sliced = fresh_model(name, SEQ)
    n = sliced.num_units
    lo, hi = {"first": (0, 2), "middle": (1, n - 1), "last": (n - 2, n), "whole": (0, n)}[where]
    return sliced.stage_module(lo, hi, params_from=model), sliced


def data(stage, sliced, seed: int = 0):
    """Input, targets (last stage) and output gradient (other stages) of one micro-batch."""
    g = torch.Generator().manual_seed(seed)
    vocab, hidden = sliced.vocab, sliced.hidden_size
    x = (torch.randint(0, vocab, (B, SEQ), generator=g) if stage.is_first
         else torch.randn(B, SEQ, hidden, generator=g))
    targets = torch.randint(0, vocab, (B, SEQ), generator=g) if stage.is_last else None
    grad_out = None if stage.is_last else torch.randn(B, SEQ, hidden, generator=g)
    return x, targets, grad_out


def _grads(stage) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in stage.named_parameters() if p.grad is not None}


def _zero(stage) -> None:
    for p in stage.parameters():
        p.grad = None


def unsliced(stage, x, targets, grad_out, scale: float = 1.0):
    """Plain autograd on the whole sequence: (output or scaled loss, input gradient, parameter gradients)."""
    _zero(stage)
    x_in = x if stage.is_first else x.clone().requires_grad_(True)
    y, _ = stage(x_in, 0, stage.empty_kv(B), targets)
    if stage.is_last:
        y = y * scale
        y.backward()
    else:
        y.backward(grad_out)
    grads = _grads(stage)
    _zero(stage)
    return y.detach(), None if stage.is_first else x_in.grad, grads


def bounds(lens=LENS):
    out, lo = [], 0
    for n in lens:
        out.append((lo, lo + n))
        lo += n
    return out


def sliced_run(stage, x, targets, grad_out, *, scale: float = 1.0, capacity: int | None = SEQ,
               backward: str = "plain", lens=LENS):
    """The same through a StageRuntime, slice by slice; `backward`: 'plain', 'split' (each
    slice's input half then its weight half) or 'deferred' (every input half, then every weight
    half in forward order, as zero-bubble schedules do)."""
    _zero(stage)
    # a split backward runs the stage's programs (tpc.compiler.programs)
    rt = StageRuntime(stage, scale, None if backward == "plain" else StagePrograms(stage))
    cuts = bounds(lens)
    outs = []
    for i, (lo, hi) in enumerate(cuts):
        tg = targets[:, lo:hi] if targets is not None else None
        outs.append(rt.forward(0, i, x[:, lo:hi], lo, targets=tg, capacity=capacity))
    assert rt.live_activations == len(cuts)
    grads_in = {}
    for i in reversed(range(len(cuts))):
        lo, hi = cuts[i]
        g = grad_out[:, lo:hi] if grad_out is not None else None
        if backward == "plain":
            grads_in[i] = rt.backward(0, i, g)
        else:
            grads_in[i] = rt.backward_input(0, i, g)
            assert rt.held_bytes(0, i) > 0
            if backward == "split":
                rt.backward_weight(0, i)
                assert rt.held_bytes(0, i) == 0
    if backward == "deferred":
        for i in range(len(cuts)):
            rt.backward_weight(0, i)
    assert rt.live_activations == 0
    y = sum(outs) if stage.is_last else torch.cat(outs, dim=1)
    g_in = None if stage.is_first else torch.cat([grads_in[i] for i in range(len(cuts))], dim=1)
    grads = _grads(stage)
    _zero(stage)
    return y, g_in, grads, rt


def assert_same(got, want):
    y, g_in, grads = got[:3]
    y_ref, g_ref, grads_ref = want
    assert relative_error(y, y_ref) <= TOL
    if g_ref is None:
        assert g_in is None
    else:
        assert relative_error(g_in, g_ref) <= TOL
    assert set(grads) == set(grads_ref)
    worst, where = gradient_error(grads, grads_ref)
    assert worst <= TOL, (worst, where)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", ["gpt", "llama", "long_conv"])
def test_slices_equal_the_unsliced_stage(name, where):
    stage, sliced = stage_of(name, where)
    x, targets, grad_out = data(stage, sliced)
    scale = 1.0 / (B * SEQ)
    want = unsliced(stage, x, targets, grad_out, scale)
    assert_same(sliced_run(stage, x, targets, grad_out, scale=scale), want)


@pytest.mark.parametrize("name", ["gpt", "long_conv"])
def test_a_cache_that_grows_gives_the_same_gradients(name):
    """Without the micro-batch's length the cache buffers grow by doubling (and a windowed one
    moves its last tokens to the front): same result, one token at a time included."""
    stage, sliced = stage_of(name, "middle")
    x, targets, grad_out = data(stage, sliced)
    want = unsliced(stage, x, targets, grad_out)
    assert_same(sliced_run(stage, x, targets, grad_out, capacity=None), want)
    assert_same(sliced_run(stage, x, targets, grad_out, capacity=None, lens=(1,) * SEQ), want)


@pytest.mark.parametrize("backward", ["split", "deferred"])
@pytest.mark.parametrize("name,where", [("gpt", "middle"), ("llama", "last"), ("long_conv", "first")])
def test_split_backward_equals_plain_backward(name, where, backward):
    stage, sliced = stage_of(name, where)
    x, targets, grad_out = data(stage, sliced)
    plain = sliced_run(stage, x, targets, grad_out)
    split = sliced_run(stage, x, targets, grad_out, backward=backward)
    assert_same(split, plain[:3])
    assert_same(split, unsliced(stage, x, targets, grad_out))


def _forwarded(stage, sliced, mb: int = 0, seed: int = 0, rt=None, upto: int = len(LENS)):
    rt = rt or StageRuntime(stage, 1.0)
    x, targets, _ = data(stage, sliced, seed)
    outs = []
    for i, (lo, hi) in enumerate(bounds()[:upto]):
        tg = targets[:, lo:hi] if targets is not None else None
        outs.append(rt.forward(mb, i, x[:, lo:hi], lo, targets=tg, capacity=SEQ))
    return rt, outs


def test_the_order_of_slices_is_checked():
    stage, sliced = stage_of("gpt", "middle")
    x, _, grad_out = data(stage, sliced)
    rt = StageRuntime(stage, 1.0)
    with pytest.raises(RuntimeError, match="slice 1 needs the KV cache of slice 0"):
        rt.forward(0, 1, x[:, 5:6], 5)
    rt, _ = _forwarded(stage, sliced, rt=rt, upto=2)
    with pytest.raises(RuntimeError, match="slice 1 already ran"):
        rt.forward(0, 1, x[:, 5:6], 5)
    with pytest.raises(RuntimeError, match="slice 0 needs the backward of slice 1 first"):
        rt.backward(0, 0, grad_out[:, :5])
    with pytest.raises(RuntimeError, match="needs the output gradient"):
        rt.backward(0, 1)
    with pytest.raises(RuntimeError, match="backward-weight of micro-batch 0 slice 1 needs its backward-input first"):
        rt.backward_weight(0, 1)
    rt.backward(0, 1, grad_out[:, 5:6])
    with pytest.raises(RuntimeError, match="slice 1: its backward already ran"):
        rt.backward(0, 1, grad_out[:, 5:6])
    rt.backward(0, 0, grad_out[:, :5])
    with pytest.raises(RuntimeError, match="backward of micro-batch 3 slice 0 .*its forward has not run"):
        rt.backward(3, 0, grad_out[:, :5])
    last, _ = stage_of("gpt", "last")
    with pytest.raises(RuntimeError, match="the last stage needs targets"):
        StageRuntime(last, 1.0).forward(0, 0, x[:, :5], 0)


def test_micro_batches_have_caches_of_their_own_and_free_kv_drops_one():
    """Two micro-batches' slices interleaved give each one's own result; freeing one leaves the
    other's cache, and the freed one starts again from slice 0."""
    stage, sliced = stage_of("llama", "middle")
    batches = [data(stage, sliced, seed) for seed in (0, 1)]
    want = [unsliced(stage, *b) for b in batches]
    rt = StageRuntime(stage, 1.0)
    outs = {0: [], 1: []}
    for i, (lo, hi) in enumerate(bounds()):
        for mb in (1, 0):
            outs[mb].append(rt.forward(mb, i, batches[mb][0][:, lo:hi], lo, capacity=SEQ))
    for mb in (0, 1):
        assert relative_error(torch.cat(outs[mb], dim=1), want[mb][0]) <= TOL
    g_in = {0: {}, 1: {}}
    for i in reversed(range(len(LENS))):
        lo, hi = bounds()[i]
        g_in[0][i] = rt.backward(0, i, batches[0][2][:, lo:hi])
    rt.free_kv(0)
    assert rt.kv_buffers(0) == [] and rt.kv_buffers(1) != []
    assert rt.live_activations == len(LENS)  # micro-batch 1's graphs
    for i in reversed(range(len(LENS))):
        lo, hi = bounds()[i]
        g_in[1][i] = rt.backward(1, i, batches[1][2][:, lo:hi])
    for mb in (0, 1):
        assert relative_error(torch.cat([g_in[mb][i] for i in range(len(LENS))], dim=1), want[mb][1]) <= TOL
    total = {n: want[0][2][n] + want[1][2][n] for n in want[0][2]}
    worst, where = gradient_error(_grads(stage), total)
    assert worst <= TOL, (worst, where)
    _zero(stage)
    rt.free_kv(1)
    assert rt.live_activations == 0 and rt.kv_buffers(1) == []
    # micro-batch 0 again: its slice 1 has no cache to read, its slice 0 starts afresh
    with pytest.raises(RuntimeError, match="needs the KV cache of slice 0"):
        rt.forward(0, 1, batches[0][0][:, 5:6], 5)
    _, again = _forwarded(stage, sliced, rt=rt)
    assert relative_error(torch.cat(again, dim=1), want[0][0]) <= TOL


def test_a_checkpointed_forward_holds_no_graph_until_recomputed():
    stage, sliced = stage_of("gpt", "whole")
    x, targets, grad_out = data(stage, sliced)
    want = unsliced(stage, x, targets, grad_out)
    rt = StageRuntime(stage, 1.0)
    loss = 0.0
    for i, (lo, hi) in enumerate(bounds()):
        loss = loss + rt.forward(0, i, x[:, lo:hi], lo, targets=targets[:, lo:hi], checkpoint=i % 2 == 0,
                                 capacity=SEQ)
    assert rt.live_activations == len(LENS) // 2
    assert relative_error(loss, want[0]) <= TOL
    last = len(LENS) - 1
    rt.backward(0, last)
    with pytest.raises(RuntimeError, match="slice 2: its forward was checkpointed; recompute it first"):
        rt.backward(0, 2)
    for i in reversed(range(last)):
        if i % 2 == 0:
            rt.recompute(0, i)
            with pytest.raises(RuntimeError, match="its graph is already held"):
                rt.recompute(0, i)
        rt.backward(0, i)
    assert rt.live_activations == 0
    worst, where = gradient_error(_grads(stage), want[2])
    assert worst <= TOL, (worst, where)


@pytest.mark.parametrize("name", ["gpt", "long_conv"])
def test_evaluate_is_the_forward_without_a_graph(name):
    stage, sliced = stage_of(name, "middle")
    x, _, grad_out = data(stage, sliced)
    want = unsliced(stage, x, None, grad_out)
    rt = StageRuntime(stage, 1.0)
    with pytest.raises(RuntimeError, match="needs the KV cache of slices 0..0; 0 have run"):
        rt.evaluate(0, 1, x[:, 5:6], 5)
    outs = [rt.evaluate(0, i, x[:, lo:hi], lo, capacity=SEQ) for i, (lo, hi) in enumerate(bounds())]
    assert all(not o.requires_grad for o in outs) and rt.live_activations == 0
    assert relative_error(torch.cat(outs, dim=1), want[0]) <= TOL
    rt.free_kv(0)
    assert rt.kv_buffers(0) == []
    assert relative_error(rt.evaluate(0, 0, x[:, :5], 0), want[0][:, :5]) <= TOL  # from slice 0 again
