"""A user's own optimizer, LR scheduler and gradient clipping on a tpc pipeline: torch.optim.SGD
with momentum, OneCycleLR and `Pipeline.clip_grad_norm_` give plain PyTorch's losses and weights
on a Hugging Face Llama, with every rank in one process and as torchrun ranks (gloo)."""

from __future__ import annotations

import torch

from tests.executors.dist_harness import launch
from tests.library.user_loops import hf_llama, plain_loop, rank_main, tpc_loop


def _close(got_losses, got, want_losses, want):
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got_losses, want_losses)), (got_losses, want_losses)
    assert len(got_losses) == len(want_losses)
    for name, value in got.items():
        assert torch.allclose(value, want[name], rtol=0, atol=1e-5), (name, (value - want[name]).abs().max())


def test_sgd_onecycle_and_clipping_match_plain_pytorch_in_one_process():
    model = hf_llama()
    want_losses, want = plain_loop(model)
    got_losses, got = tpc_loop(model, interpret=True, stages=2, microbatches=2, slices=(5, 11), schedule="1f1b")
    assert set(got) == set(want)  # every parameter, by the model's own names (the tie once)
    _close(got_losses, got, want_losses, want)


def test_a_tensor_axis_and_data_replicas_match_too_in_one_process():
    """Two stages x two tensor ranks x two replicas: the clipping norm counts each shard once
    and the state_dict joins the shards."""
    model = hf_llama()
    want_losses, want = plain_loop(model)
    got_losses, got = tpc_loop(model, interpret=True, stages=2, tensor=2, dp=2, microbatches=2, slices=2)
    assert set(got) == set(want)
    _close(got_losses, got, want_losses, want)


def test_sgd_onecycle_and_clipping_match_plain_pytorch_under_torchrun(tmp_path):
    """Two stages x two data-parallel replicas, four gloo ranks; the tied embedding and head on
    the first and last stage."""
    options = dict(stages=2, dp=2, microbatches=2, slices=2)
    codes, errs = launch(4, tmp_path, rank_main, options, limit=300)
    assert codes == [0] * 4, errs
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    want_losses, want = plain_loop(hf_llama())
    got: dict[str, torch.Tensor] = {}
    for part in parts:
        assert part["losses"] == parts[0]["losses"]  # the global loss on every rank
        got.update(part["state"])
    assert set(got) == set(want)
    _close(parts[0]["losses"], got, want_losses, want)
