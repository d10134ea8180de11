"""Units, cached-tensor layout and the runtime's ordering errors."""

from __future__ import annotations

import pytest
import torch

from tpc.compiler.frontend import SlicedModel
from tpc.executors.stage_runtime import StageRuntime

from .harness import tiny_model


@pytest.fixture(scope="module")
def llama():
    return SlicedModel.from_model(tiny_model("llama"), seq_len=16, vocab=256)


def test_units_are_blocks_with_labels_and_params(llama):
    assert llama.unit_labels == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm+output"]
    total = sum(p.numel() for p in llama.model.parameters())
    assert sum(llama.unit_param_counts) == total  # no tying in Llama: each parameter counted once
    assert llama.hidden_size == 32
    assert llama.partition_by_params(5) == [(i, i + 1) for i in range(5)]


def test_gqa_caches_the_unrepeated_heads(llama):
    st = llama.stage_module(1, 2)
    assert st.num_kv == 2 and st.kv_dims == [2, 2]
    assert [tuple(t.shape) for t in st.empty_kv(3)] == [(3, 2, 0, 8), (3, 2, 0, 8)]  # 2 kv heads, not 4


def test_stage_parameters_keep_model_names(llama):
    st = llama.stage_module(1, 3)
    names = {n for n, _ in st.named_parameters()}
    assert names == {n for n, _ in llama.model.named_parameters() if n.startswith(("layers.0.", "layers.1."))}


def test_runtime_refuses_out_of_order_slices(llama):
    rt = StageRuntime(llama.stage_module(1, 2), 1.0)
    x = torch.randn(2, 4, 32)
    with pytest.raises(RuntimeError, match="slice 0"):
        rt.forward(0, 1, x, 4)
    rt.forward(0, 0, x, 0)
    rt.forward(0, 1, x, 4)
    assert rt.live_activations == 2
    with pytest.raises(RuntimeError, match="slice 1 first"):
        rt.backward(0, 0, torch.ones(2, 4, 32))
    g1 = rt.backward(0, 1, torch.ones(2, 4, 32))
    g0 = rt.backward(0, 0, torch.ones(2, 4, 32))
    assert g1.shape == g0.shape == (2, 4, 32) and rt.live_activations == 0
    rt.free_kv(0)
    with pytest.raises(RuntimeError, match="forward has not run"):
        rt.backward(0, 0, torch.ones(2, 4, 32))


def test_mask_buffer_as_long_as_the_sequence():
    """nanoGPT with block_size == seq_len: export guards T != L there; the front end still
    serves every slice length up to L, gradients included."""
    from tpc.compiler.frontend.model_file import import_model_file
    from tpc.executors.oracle import max_rel_error, reference_step

    from .harness import EXAMPLES, batch, sliced_step, summed

    torch.manual_seed(0)
    model = import_model_file(str(EXAMPLES / "nanogpt.py")).model(n_layer=2, n_embd=32, n_head=2, block_size=16)
    sm = SlicedModel.from_model(model, seq_len=16, vocab=256)
    ids, targets = batch(256, 2, 16)
    loss, per_stage = sliced_step(sm, sm.partition_by_params(2), ids, targets, 1, [16])
    ref_loss, ref = reference_step(model, ids, targets)
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    assert max_rel_error(summed(per_stage), ref) <= 1e-5


def _sliced_run(stage, lengths, capacity):
    """Forward then backward of one micro-batch in slices of `lengths`; the input gradients,
    the parameter gradients, and the KV buffers' storages seen after each forward."""
    torch.manual_seed(1)
    xs = [torch.randn(2, n, 32) for n in lengths]
    grads = [torch.randn(2, n, 32) for n in lengths]
    for p in stage.parameters():
        p.grad = None
    rt = StageRuntime(stage, 1.0)
    storages, start = [], 0
    for i, x in enumerate(xs):
        rt.forward(0, i, x, start, capacity=capacity)
        start += x.size(1)
        storages.append([k.untyped_storage().data_ptr() for k in rt.kv_buffers(0)])
    gx = [rt.backward(0, len(xs) - 1, grads[-1])]
    # the gradients sent into the cache cover every slice but the last (none reads its K/V)
    assert [(acc.base, acc.g.size(d)) for acc, d in zip(rt._caches[0].grad, stage.kv_dims)] == \
        [(0, start - lengths[-1])] * len(stage.kv_dims)
    gx += [rt.backward(0, i, grads[i]) for i in reversed(range(len(xs) - 1))]
    return gx, [p.grad.clone() for p in stage.parameters()], storages


def test_known_capacity_allocates_the_kv_buffers_once(llama):
    """With the micro-batch's length known, every slice writes into the buffers the first
    allocated (no doubling: earlier slices' prefix views cannot pin an outgrown buffer), and
    the gradients are the doubling runtime's."""
    stage = llama.stage_module(1, 3)
    lengths = [3, 5, 2, 6]
    gx, gp, storages = _sliced_run(stage, lengths, capacity=sum(lengths))
    assert all(s == storages[0] for s in storages)
    gx_grow, gp_grow, storages_grow = _sliced_run(stage, lengths, capacity=None)
    assert len({tuple(s) for s in storages_grow}) > 1  # the fallback does move its buffers
    for a, b in zip(gx + gp, gx_grow + gp_grow):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
