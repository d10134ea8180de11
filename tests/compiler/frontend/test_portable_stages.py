"""Stage graphs do not depend on how the trace happened to lay out or place its values: they run
under another SDPA backend than the one the capture saw, with the oracle's loss and gradients,
and on whatever device the stage is moved to."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tpc.compiler.frontend import SlicedModel, load_model
from tpc.executors.oracle import max_rel_error, reference_step

from .harness import batch, sliced_step, summed
from .test_sliced_grads import BATCH, SEQ, VOCAB, sliced

MODELS = Path(__file__).resolve().parent / "models"
_FIXED = {}


def model_and_sliced(name):
    """The tiny examples, and the fixture whose forward makes tensors with fixed devices."""
    if name != "fixed_devices":
        return sliced(name)
    if name not in _FIXED:
        torch.manual_seed(0)
        m = load_model(str(MODELS / "fixed_devices.py"))
        _FIXED[name] = (m, SlicedModel.from_model(m, seq_len=SEQ, vocab=64))
    return _FIXED[name]


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


NAMES = ["gpt", "nanogpt", "llama", "fixed_devices"]


def _stage_ranges(sm):
    return [(u, u + 1) for u in range(sm.num_units)] + [(0, sm.num_units)]


def _fixed_devices(graph: fx.Graph) -> list[tuple[str, torch.device]]:
    found = []
    for n in graph.nodes:
        fx.node.map_aggregate((n.args, n.kwargs),
                              lambda a: found.append((n.name, a)) if isinstance(a, torch.device) else None)
    return found


@pytest.mark.parametrize("name", NAMES)
def test_no_stage_graph_names_a_device(name):
    """Every tensor a stage graph creates takes its device from the stage's input."""
    _, sm = model_and_sliced(name)
    for lo, hi in _stage_ranges(sm):
        assert _fixed_devices(sm.stage_module(lo, hi).graph) == [], (name, lo, hi)


class _OutputDevices(TorchDispatchMode):
    """The device of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.add((str(func), t.device.type))
        return out


def _slice_inputs(st, sm, vocab, batch_rows, off, ln, device):
    if st.is_first:
        x = torch.randint(0, vocab, (batch_rows, ln), device="cpu").to(device)
    else:
        x = torch.randn(batch_rows, ln, sm.hidden_size).to(device)
    prefix = []
    for e, d in zip(st.empty_kv(batch_rows), st.kv_dims):
        shape = list(e.shape)
        shape[d] = off
        prefix.append(torch.randn(shape, dtype=e.dtype).to(device))
    targets = torch.randint(0, vocab, (batch_rows, ln)).to(device) if st.is_last else None
    return x, prefix, targets


@pytest.mark.parametrize("name", NAMES)
def test_stage_moved_to_another_device_computes_there(name):
    """One built stage runs on the CPU and, moved with `.to("meta")`, on the meta device: a slice
    with a prefix, every op's result on the stage's device, outputs of the slice's shape. The
    code is not generated again."""
    model, sm = model_and_sliced(name)
    vocab = 64 if name == "fixed_devices" else VOCAB
    b, off, ln = 2, 5, 3
    for lo, hi in _stage_ranges(sm):
        st = sm.stage_module(lo, hi, params_from=copy.deepcopy(model))
        code = st.code
        torch.manual_seed(0)
        x, prefix, targets = _slice_inputs(st, sm, vocab, b, off, ln, "cpu")
        y_cpu, kv_cpu = st(x, off, prefix, targets)
        st.to("meta")
        assert all(t.device.type == "meta" for t in [*st.parameters(), *st.buffers()])
        x, prefix, targets = _slice_inputs(st, sm, vocab, b, off, ln, "meta")
        with _OutputDevices() as seen:
            y, kv = st(x, off, prefix, targets)
        assert {dev for _, dev in seen.seen} == {"meta"}, (name, lo, hi, sorted(seen.seen))
        assert y.device.type == "meta" and y.shape == y_cpu.shape
        assert y.shape == (() if st.is_last else (b, ln, sm.hidden_size))
        assert len(kv) == st.num_kv
        for k, k_cpu, d in zip(kv, kv_cpu, st.kv_dims):
            assert k.device.type == "meta" and k.shape == k_cpu.shape and k.shape[d] == ln
        assert st.code == code
