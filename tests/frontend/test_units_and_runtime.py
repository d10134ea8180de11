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
    from tpc.compiler.frontend.load import import_model_file
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
