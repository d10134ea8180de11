"""Sliced pipeline execution equals plain autograd on the unsliced model: same loss, same
gradients (fp32, relative error <= 1e-5), for GPT (SDPA), nanoGPT (written-out attention with a
mask buffer) and Llama (RoPE, GQA), over stage counts, micro-batches and slice lengths."""

from __future__ import annotations

import pytest
import torch

from tpc.compiler.frontend import SlicedModel
from tpc.executors.oracle import max_rel_error, reference_step

from .harness import batch, sliced_step, summed, tiny_model

SEQ, BATCH, VOCAB = 16, 4, 256
_CACHE = {}


def sliced(name):
    if name not in _CACHE:
        m = tiny_model(name)
        _CACHE[name] = (m, SlicedModel.from_model(m, seq_len=SEQ, vocab=VOCAB))
    return _CACHE[name]


CASES = [
    # model, stages, micro-batches, slice lengths
    ("gpt", 1, 1, [16]),
    ("gpt", 2, 2, [8, 8]),
    ("gpt", 3, 1, [1, 3, 5, 7]),
    ("gpt", 4, 2, [1, 1, 1, 1, 2, 2, 4, 4]),
    ("gpt", 5, 1, [2, 14]),
    ("nanogpt", 1, 2, [5, 11]),
    ("nanogpt", 2, 1, [1, 15]),
    ("nanogpt", 3, 2, [2, 2, 2, 2, 2, 2, 2, 2]),
    ("nanogpt", 4, 1, [4, 4, 4, 4]),
    ("llama", 1, 1, [16]),
    ("llama", 2, 2, [3, 13]),
    ("llama", 3, 1, [1, 1, 14]),
    ("llama", 4, 2, [1, 2, 3, 4, 6]),
    ("llama", 2, 1, [2, 2, 2, 2, 2, 2, 2, 2]),
]


@pytest.mark.parametrize("name,k,n_mb,lens", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_sliced_matches_oracle(name, k, n_mb, lens):
    model, sm = sliced(name)
    ids, targets = batch(VOCAB, BATCH, SEQ)
    ranges = sm.partition_by_params(k)
    assert len(ranges) == k and ranges[0][0] == 0 and ranges[-1][1] == sm.num_units
    loss, per_stage = sliced_step(sm, ranges, ids, targets, n_mb, lens)
    ref_loss, ref_grads = reference_step(model, ids, targets)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    grads = summed(per_stage)
    assert set(grads) == set(ref_grads)
    assert max_rel_error(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("name,mode", [("gpt", "checkpoint"), ("llama", "split"), ("nanogpt", "checkpoint+split")])
def test_checkpoint_and_split_backward_match_oracle(name, mode):
    model, sm = sliced(name)
    ids, targets = batch(VOCAB, BATCH, SEQ, seed=3)
    loss, per_stage = sliced_step(sm, sm.partition_by_params(2), ids, targets, 2, [3, 1, 12],
                                  checkpoint="checkpoint" in mode, split_backward="split" in mode)
    ref_loss, ref_grads = reference_step(model, ids, targets)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert max_rel_error(summed(per_stage), ref_grads) <= 1e-5


def test_tied_weight_gradient_is_the_exact_sum_over_stages():
    model, sm = sliced("gpt")
    ranges = sm.partition_by_params(3)
    ties = sm.ties(ranges)
    assert ties == [("transformer.wte.weight", (0, len(ranges) - 1))]
    ids, targets = batch(VOCAB, BATCH, SEQ, seed=5)
    _, per_stage = sliced_step(sm, ranges, ids, targets, 1, [6, 10])
    name = "transformer.wte.weight"
    first, last = per_stage[0][name], per_stage[-1][name]
    # each stage holds part of the gradient (embedding rows; head matrix) and only the sum is right
    _, ref = reference_step(model, ids, targets)
    assert max_rel_error({name: first}, {name: ref[name]}) > 1e-2
    assert max_rel_error({name: first + last}, {name: ref[name]}) <= 1e-5
    assert name not in per_stage[1]


def test_same_rank_stages_share_parameter_objects():
    model, sm = sliced("gpt")
    a = sm.stage_module(0, 1, params_from=model)
    b = sm.stage_module(sm.num_units - 1, sm.num_units, params_from=model)
    assert dict(a.named_parameters())["transformer.wte.weight"] is dict(b.named_parameters())["transformer.wte.weight"]
    assert dict(a.named_parameters())["transformer.wte.weight"] is model.transformer.wte.weight


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_fused_bottom_right_bias_matches_oracle(name, monkeypatch):
    """The causal bias CUDA tensors take for a slice with a prefix (`causal_lower_right`, so
    SDPA may pick the flash kernel) is forced here on CPU, where PyTorch materialises it: the
    same loss and gradients as the oracle, so the bias is aligned as the slicing needs."""
    from tpc.compiler.frontend import runtime_ops as ops

    model, sm = sliced(name)  # built first: building checks slices of its own lengths
    used = []
    monkeypatch.setattr(ops, "_fused_bottom_right", lambda q: used.append(q.size(-2)) or True)
    ids, targets = batch(VOCAB, BATCH, SEQ)
    loss, per_stage = sliced_step(sm, sm.partition_by_params(2), ids, targets, 1, [3, 5, 8])
    ref_loss, ref_grads = reference_step(model, ids, targets)
    assert used and set(used) == {5, 8}  # the slices with a prefix, in every layer
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert max_rel_error(summed(per_stage), ref_grads) <= 1e-5


def _lower_right_reference(q, k, v, scale=None):
    """Plain attention with the bottom-right causal mask, in float32."""
    lq, lk = q.size(-2), k.size(-2)
    sees = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    s = (q.float() @ k.float().transpose(-1, -2)) * (scale or q.size(-1) ** -0.5)
    return torch.softmax(s.masked_fill(~sees, float("-inf")), dim=-1) @ v.float()


def test_fused_bottom_right_under_bf16_autocast_takes_one_dtype(monkeypatch):
    """On CUDA a slice with a prefix hands SDPA `causal_lower_right`, which picks the flash (or
    memory-efficient) kernel itself, ahead of autocast: q and k in float32 (rotary embeddings)
    with v in bf16 failed there ("Expected query, key, and value to have the same dtype"). The
    kernel eligibility and the flash kernel are stubbed on CPU with the math reference: the
    kernel now gets q, k, v in the autocast dtype and the result is the reference's."""
    import torch.nn.attention.bias as bias_mod

    from tpc.compiler.frontend import runtime_ops as ops

    got = []

    def flash(q, k, v, dropout_p, is_causal=False, return_debug_mask=False, scale=None):
        got.append((q.dtype, k.dtype, v.dtype, is_causal))
        return (_lower_right_reference(q, k, v, scale).to(q.dtype),)

    monkeypatch.setattr(ops, "_fused_bottom_right", lambda q: True)
    monkeypatch.setattr(bias_mod, "can_use_flash_attention", lambda params: True)
    monkeypatch.setattr(bias_mod.torch.ops.aten, "_scaled_dot_product_flash_attention", flash)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 3, 8)  # float32: rotated
    k, k_prefix = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8)
    v, v_prefix = torch.randn(2, 4, 3, 8).bfloat16(), torch.randn(2, 4, 5, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.causal_attention(q, k, v, k_prefix, v_prefix)
    assert got == [(torch.bfloat16, torch.bfloat16, torch.bfloat16, True)]
    ref = _lower_right_reference(q.bfloat16(), torch.cat([k_prefix, k], -2).bfloat16(),
                                 torch.cat([v_prefix, v], -2))
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, atol=2e-2)
    # without the cast the fused path refuses the mixed dtypes, as it did on CUDA
    monkeypatch.setattr(ops.torch, "is_autocast_enabled", lambda *a: False)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="same dtype"):
        ops.causal_attention(q, k, v, k_prefix, v_prefix)
