"""Stage graphs do not depend on how the trace happened to lay out or place its values: they run
under another SDPA backend than the one the capture saw, with the oracle's loss and gradients."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tpc.executors.oracle import max_rel_error, reference_step

from .harness import batch, sliced_step, summed
from .test_sliced_grads import BATCH, SEQ, VOCAB, sliced


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_math_sdpa_backend_matches_oracle(name):
    """The capture ran the CPU flash SDPA, whose output's transpose is contiguous, so GPT's
    `y.transpose(1, 2).contiguous().view(B, T, C)` was traced as a plain `view`. The math
    backend (CUDA's math and memory-efficient paths likewise) lays the output out otherwise;
    the stage graphs must still run, with the oracle's numbers."""
    model, sm = sliced(name)
    ids, targets = batch(VOCAB, BATCH, SEQ, seed=7)
    with sdpa_kernel(SDPBackend.MATH):
        loss, per_stage = sliced_step(sm, sm.partition_by_params(3), ids, targets, 2, [3, 5, 8])
        ref_loss, ref_grads = reference_step(model, ids, targets)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    grads = summed(per_stage)
    assert set(grads) == set(ref_grads)
    assert max_rel_error(grads, ref_grads) <= 1e-5


def test_stage_graphs_have_no_view():
    """A `view` depends on the input's strides; the stage graphs reshape instead (a view
    whenever one is possible, as on the traced layout)."""
    for name in ("gpt", "nanogpt", "llama"):
        _, sm = sliced(name)
        for u in range(sm.num_units):
            targets = {n.target for n in sm.stage_module(u, u + 1).graph.nodes if n.op == "call_function"}
            assert not targets & {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}, (name, u)
