"""State-space layers: Mamba's and Mamba-2's scans, RWKV's WKV and RecurrentGemma's RG-LRU carry
their state from token slice to token slice (`ssm_state.py`, `ssm_ops.py`). Tiny Hugging Face
models from configs (random weights), Mamba, FalconMamba, Mamba-2 and the hybrids built on them
(Jamba, Zamba, Bamba, Zamba2, GraniteMoeHybrid, NemotronH, FalconH1), RWKV and RecurrentGemma, 2 and 3 stages with equal, unequal and one-token slices:
loss and every gradient within 1e-5 of plain autograd on the model as written (Hugging Face's
own reference scans). The scans themselves against Hugging Face's functions; the memory model's
count of a carried state; the refusals of what is not built with them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")

from tpc.compiler.frontend import SlicedModel  # noqa: E402
from tpc.compiler.frontend import ssm_ops  # noqa: E402
from tpc.compiler.frontend.ssm_state import KIND, STATE, ScanSite  # noqa: E402
from tpc.ir.diagnostics import TpirError  # noqa: E402

from .harness import assert_sliced_exact  # noqa: E402
from .hf_models import VOCAB, config_dict, hf_model  # noqa: E402

SEQ, ROWS, MICROBATCHES = 16, 4, 2
SLICINGS = [[4, 4, 4, 4], [5, 2, 9], [1, 1, 1, 13]]
CUTS = [(0, 5), (5, 6), (6, 13)]  # a slice of five, of one, of seven tokens


def _scans(sm) -> list:
    return [s for s in sm.context.states if isinstance(s, ScanSite)]


# ------------------------------------------------------------------ the scans

def test_mambas_scan_slice_by_slice_is_hugging_faces_over_the_whole():
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    torch.manual_seed(0)
    b, d, n, length = 2, 6, 4, 13
    x, dt, z = torch.randn(b, d, length), torch.randn(b, d, length), torch.randn(b, d, length)
    A, B, C = -torch.rand(d, n), torch.randn(b, n, length), torch.randn(b, n, length)
    D, bias = torch.randn(d), torch.randn(d)
    ref = mamba_selective_scan(x, dt, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True)
    assert torch.equal(torch.ops.tpc.selective_scan(x, dt, A, B, C, D, z, bias, True), ref)
    state, parts = torch.zeros(b, 0, d, n), []
    for lo, hi in CUTS:
        s = slice(lo, hi)
        y, state = ssm_ops.selective_scan_carried(x[..., s], dt[..., s], A, B[..., s], C[..., s], D, z[..., s], bias,
                                                  True, state)
        assert state.shape == (b, 1, d, n)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, dim=-1), ref, rtol=1e-6, atol=1e-6)


def test_mamba2s_chunked_scan_slice_by_slice_is_hugging_faces_over_the_whole():
    """The slices' chunks start at each slice's first token, not at multiples of the chunk: the
    same sums grouped otherwise."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    torch.manual_seed(0)
    b, length, heads, p, groups, n, chunk = 2, 13, 4, 3, 2, 5, 4
    x, dt = torch.randn(b, length, heads, p), torch.randn(b, length, heads)
    A, B, C = -2 * torch.rand(heads), torch.randn(b, length, groups, n), torch.randn(b, length, groups, n)
    D, bias = torch.randn(heads), torch.randn(heads)
    ref = mamba2_chunk_scan(x, dt, A, B, C, chunk_size=chunk, D=D, dt_bias=bias, dt_softplus=True)
    inf = float("inf")
    assert torch.equal(torch.ops.tpc.ssd_scan(x, dt, A, B, C, D, bias, True, 0.0, inf, chunk), ref)
    state, parts = torch.zeros(b, 0, heads, p, n), []
    for lo, hi in CUTS:
        s = slice(lo, hi)
        y, state = ssm_ops.ssd_scan_carried(x[:, s], dt[:, s], A, B[:, s], C[:, s], D, bias, True, 0.0, inf, chunk,
                                            state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, rtol=1e-5, atol=1e-5)


def test_rwkvs_wkv_and_the_rg_lru_slice_by_slice_are_hugging_faces_over_the_whole():
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    torch.manual_seed(0)
    b, length, c = 2, 13, 6
    decay, first = torch.randn(c), torch.randn(c)
    key, value = 3 * torch.randn(b, length, c), torch.randn(b, length, c)
    ref, _ = rwkv_linear_attention_cpu(decay, first, key, value)
    assert torch.equal(torch.ops.tpc.wkv(decay, first, key, value), ref)
    state, parts = torch.zeros(b, 0, 3, c), []
    for lo, hi in CUTS:
        y, state = ssm_ops.wkv_carried(decay, first, key[:, lo:hi], value[:, lo:hi], state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, rtol=1e-6, atol=1e-6)

    x, a = torch.randn(b, length, c), torch.rand(b, length, c)
    reset = torch.zeros(b, length, 1, dtype=torch.bool)
    ref, _ = RecurrentGemmaRglru._rnn_scan(None, x, a, reset, None)
    assert torch.equal(torch.ops.tpc.linear_scan(x, a), ref)
    state, parts = torch.zeros(b, 0, c), []
    for lo, hi in CUTS:
        y, state = ssm_ops.linear_scan_carried(x[:, lo:hi], a[:, lo:hi], state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, rtol=1e-6, atol=1e-6)


def test_the_captured_ops_gradients_are_hugging_faces():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    torch.manual_seed(1)
    x, dt, A = torch.randn(1, 9, 2, 3), torch.randn(1, 9, 2), -torch.rand(2)
    B, C = torch.randn(1, 9, 1, 4), torch.randn(1, 9, 1, 4)
    ours = [t.clone().requires_grad_() for t in (x, dt, A, B, C)]
    theirs = [t.clone().requires_grad_() for t in (x, dt, A, B, C)]
    torch.ops.tpc.ssd_scan(*ours, None, None, True, 0.0, float("inf"), 4).square().sum().backward()
    mamba2_chunk_scan(*theirs, chunk_size=4, dt_softplus=True).square().sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the families

@pytest.mark.parametrize("family,scans,attention", [
    ("mamba", 2, 0), ("falcon_mamba", 2, 0), ("jamba", 1, 1), ("zamba", 8, 2),
    ("mamba2", 2, 0), ("bamba", 1, 1), ("zamba2", 2, 1), ("granitemoehybrid", 1, 1), ("nemotron_h", 1, 1),
    ("falcon_h1", 2, 2), ("rwkv", 2, 0), ("recurrent_gemma", 2, 1),
])
def test_state_space_families_are_exact(family, scans, attention):
    """Each scan becomes a carried site (none left to the capture's loop or the token-mixing
    rules), beside the attention layers of the hybrids; Zamba runs two Mamba heads per layer.
    The reference is a second instance with the same weights: RecurrentGemma keeps its last
    recurrent state on the module, which the harness's copy of the sliced model would refuse."""
    sm = SlicedModel.from_model(hf_model(family, "eager"), seq_len=SEQ, vocab=VOCAB)
    assert len(_scans(sm)) == scans and len(sm.context.attention) == attention
    stages = (2, 3) if sm.num_units >= 3 else (2,)
    assert_sliced_exact(hf_model(family, "eager"), sm, VOCAB, ROWS, SEQ, MICROBATCHES, SLICINGS, stages=stages)


def test_the_self_check_leaves_the_models_own_state_as_it_was():
    """RecurrentGemma stores its last recurrent state on its module when it runs; the
    compile's self-check runs the model and puts back what it held (None), so the model can be
    copied afterwards."""
    import copy

    model = hf_model("recurrent_gemma", "eager")
    SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    assert all(m.recurrent_states is None for m in model.modules() if hasattr(m, "recurrent_states"))
    copy.deepcopy(model)


def test_the_capture_holds_one_op_per_scan_and_no_loop_over_the_tokens():
    """Mamba's reference scan is a loop over the tokens; captured, it is one op whatever the
    length, and the carried form after the rewrite."""
    sm = SlicedModel.from_model(hf_model("mamba", "eager"), seq_len=SEQ, vocab=VOCAB)
    original = [n for n in sm.original_graph.nodes if n.target is torch.ops.tpc.selective_scan.default]
    assert len(original) == 2
    carried = [n for n in sm.context.graph.nodes if n.meta.get("tpc_kind") == KIND
               and n.target is ssm_ops.selective_scan_carried]
    assert len(carried) == 2
    # the model's module runs its own scan again after the capture
    from transformers.models.mamba import modeling_mamba

    assert modeling_mamba.mamba_selective_scan.__name__ == "mamba_selective_scan"
    assert modeling_mamba.mamba_selective_scan.__module__ == modeling_mamba.__name__


def test_the_memory_model_counts_a_carried_state_per_sequence_not_per_token():
    """Mamba-2 (8 heads x head_dim 8 x state 8 = 512 elements of state per sequence) beside its
    convolution's window of 4 tokens: the state is held for at most two slices (the last
    slice's and the one being written), whatever the slices' lengths."""
    from tpc.compiler.costmodel.devices import H100
    from tpc.compiler.costmodel.graph import GraphCostModel, GraphCosts

    sm = SlicedModel.from_model(hf_model("mamba2", "eager"), seq_len=SEQ, vocab=VOCAB)
    assert sm.unit_kv[1] == [(96, 4), (512, STATE)]
    assert sm.unit_kv_elements[1] == 96  # the convolution's window: per token
    costs = GraphCosts.from_sliced(sm, float_bytes=4)
    model = GraphCostModel(H100, costs, [(0, 2), (2, sm.num_units)])
    state = 512 * 4
    # the window's min(T, w - 1 + longest) tokens charged to the first slices, the state to two
    assert model.kv_slice_bytes(0, [4, 4, 4, 4], mb_size=1) == [96 * 4 * 4 + state, 96 * 4 * 3 + state, 0, 0]
    assert model.kv_slice_bytes(0, [8, 8], mb_size=1) == [96 * 4 * 8 + state, 96 * 4 * 3 + state]
    assert model.kv_slice_bytes(0, [16], mb_size=3) == [3 * (96 * 4 * 16 + state)]


# ------------------------------------------------------------------ refused with

def _hf_config(tmp_path, family: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_dict(family, attn_implementation="eager")))
    return str(path)


def test_packed_documents_are_refused_at_the_scan(tmp_path):
    from tpc.cli.main import main

    from tpc.compiler.frontend.documents import refuse_unresettable

    sm = SlicedModel.from_model(hf_model("mamba2", "eager"), seq_len=SEQ, vocab=VOCAB)
    with pytest.raises(TpirError) as err:  # the first carried state: the mixer's convolution
        sm.check_documents()
    assert "packed documents" in err.value.diagnostics[0].message
    with pytest.raises(TpirError) as err:  # the scan's own refusal
        refuse_unresettable(_scans(sm), sm.context.model_file)
    d = err.value.diagnostics[0]
    assert "state-space scan" in d.message and "document" in d.message
    assert d.loc is not None and d.loc.file.endswith("modeling_mamba2.py")
    code = main(["compile", _hf_config(tmp_path, "mamba2"), "-o", str(tmp_path / "p.tpir"), "--stages", "2",
                 "--seq-len", "16", "--batch", "2", "--documents", "eos:2"])
    assert code != 0 and not (tmp_path / "p.tpir").exists()


def test_tensor_parallelism_is_refused_in_the_mixer():
    from tpc.compiler.tensor.split import find_split

    sm = SlicedModel.from_model(hf_model("mamba", "eager"), seq_len=SEQ, vocab=VOCAB)
    ctx = sm.context
    with pytest.raises(TpirError) as err:  # at the mixer's first op that cannot be split
        find_split(ctx.graph, 2, ctx.param_names, ctx.model_file)
    d = err.value.diagnostics[0]
    assert "cannot split for tensor degree 2" in d.message and "MambaMixer" in d.message


def test_random_ltd_is_refused_on_a_unit_with_a_scan():
    from tpc.compiler.frontend.random_ltd import check_droppable

    sm = SlicedModel.from_model(hf_model("mamba", "eager"), seq_len=SEQ, vocab=VOCAB)
    with pytest.raises(TpirError) as err:  # the mixer's convolution comes first
        check_droppable(sm.context, [1])
    assert "causal convolution" in err.value.diagnostics[0].message
    ctx = dataclasses.replace(sm.context, states=tuple(_scans(sm)))  # the scan alone
    with pytest.raises(TpirError) as err:
        check_droppable(ctx, [1])
    assert "state-space scan" in err.value.diagnostics[0].message
