"""What a split backward holds between its halves: `backward-input` keeps the output gradients
its `backward-weight` needs (dY of dW = dY^T X, the stage's backward_weight program, compiler/programs/joint.py) until that runs.
The graph cost model counts them from the traced graph, `tpc profile` measures them
(`StageRuntime.held_bytes`), and a rank's memory carries them from the start of a
backward-input to the end of its backward-weight (compiler/predict/memory.py)."""

from __future__ import annotations

import pytest
import torch

from tpc.compiler.costmodel import PRESETS, load_cost_model
from tpc.compiler.costmodel.base import CostModel
from tpc.compiler.costmodel.graph import GraphCostModel, GraphCosts
from tpc.compiler.frontend import SlicedModel
from tpc.compiler.frontend.model_file import import_model_file
from tpc.compiler.predict.memory import rank_memory
from tpc.compiler.programs.stage_programs import StagePrograms
from tpc.executors.stage_runtime import StageRuntime
from tpc.ir.nodes import Op
from tests.compiler.costmodel.tiny_model import L
from tests.ir.plans import simple_plan

C = 32  # width


@pytest.fixture(scope="module")
def gpt(repo_root):
    torch.manual_seed(0)
    m = import_model_file(str(repo_root / "examples" / "gpt.py")).model(n_layer=2, n_embd=C, n_head=4,
                                                                       vocab_size=64, block_size=32)
    return SlicedModel.from_model(m, seq_len=32, vocab=64)


def held(C: int, l: int, b: int) -> int:
    """A GPT block's held bytes (fp32): the output gradients of its linear layers, qkv (3C),
    the attention projection (C) and the MLP's two (4C, C), 9C per token; and the two layer
    norms' weight and bias gradients, handed over in the input half (4C, not per token)."""
    return (9 * C * l * b + 4 * C) * 4


def test_a_block_holds_the_gradients_of_its_linear_outputs_and_norm_weights(gpt):
    cm = GraphCostModel(PRESETS["a100"], GraphCosts.from_sliced(gpt, float_bytes=4),
                        [(u, u + 1) for u in range(gpt.num_units)])
    for l, b in ((8, 1), (16, 3)):
        assert cm.held_grad_bytes(1, l, 8, b) == held(C, l, b)
        assert cm.held_grad_bytes(2, l, 0, b) == held(C, l, b)
    # the last unit: the final norm's weight and bias (2C) and the head, which multiplies the
    # tied embedding with the final hidden state (the logits, vocabulary 64)
    assert cm.held_grad_bytes(3, 8, 0, 2) == (8 * 2 * 64 + 2 * C) * 4


def test_what_the_runtime_keeps_is_what_the_graph_counts(gpt):
    """A real split backward of one block keeps exactly the bytes the graph model counts."""
    stage = gpt.stage_module(1, 2)
    rt = StageRuntime(stage, 1.0, StagePrograms(stage))
    b, l = 2, 8
    x = torch.randn(b, l, C)
    y = rt.forward(0, 0, x, 0, None)
    rt.backward_input(0, 0, torch.randn_like(y))
    kept = rt.held_bytes(0, 0)
    rt.backward_weight(0, 0)
    cm = GraphCostModel(PRESETS["a100"], GraphCosts.from_sliced(gpt, float_bytes=4), [(0, 1), (1, 2), (2, 4)])
    assert kept == cm.held_grad_bytes(1, l, 0, b) == held(C, l, b)


def test_the_profile_measures_and_fits_them(tiny_profile):
    prof = tiny_profile["profile"]
    block = prof.units[1]  # the tiny model: embedding, one block of width 16, head
    assert block.held and len(block.held_samples) == len(block.samples)
    for b, l, c, nbytes in block.held_samples:
        assert nbytes == held(16, l, b)
    cm = load_cost_model(cost=str(tiny_profile["path"]), stage_units=[(0, 1), (1, 2), (2, 3)])
    assert cm.held_grad_bytes(1, 12, 4, 1) == pytest.approx(held(16, 12, 1), rel=0.02)
    assert cm.held_grad_bytes(1, L, 0, 3) == pytest.approx(held(16, L, 3), rel=0.02)


class _Held(CostModel):
    """Unit-like costs: a slice's stash 1, what a split backward holds 10, nothing else."""

    num_stages = 2

    def slice_time(self, stage, l, c, mb_size):
        return 1.0, 2.0

    def p2p_time(self, nbytes):
        return 0.0

    def activation_bytes(self, l, mb_size):
        return 1.0

    def kv_bytes(self, stage, l, mb_size):
        return 0.0

    def param_bytes(self, stage):
        return 0.0

    def held_grad_bytes(self, stage, l, c, mb_size):
        return 10.0


def test_a_rank_holds_them_from_backward_input_to_backward_weight():
    plan = simple_plan(2, 2, 2, split_backward=True)
    instrs = plan.program(0).instrs
    mem = rank_memory(plan.header, 0, instrs, _Held())
    open_ = set()
    for instr, m in zip(instrs, mem.during):
        if instr.op is Op.BACKWARD_INPUT:
            open_.add(instr.key)
        assert m.held_grads == 10.0 * len(open_), (instr, m)
        if instr.op is Op.BACKWARD_WEIGHT:
            open_.discard(instr.key)
    assert mem.peak.held_grads > 0
    # a plain backward holds none
    plain = simple_plan(2, 2, 2)
    assert all(m.held_grads == 0 for m in rank_memory(plain.header, 0, plain.program(0).instrs, _Held()).during)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_hugging_face_block_keeps_what_the_graph_counts(family):
    """Code nobody here wrote: a Llama layer (RMSNorm as weight * x, gated MLP, no biases) and a
    GPT-2 block (Conv1D linears, addmm) keep in a real split backward the bytes the graph counts."""
    pytest.importorskip("transformers")
    from tests.compiler.frontend.hf_models import VOCAB, hf_model

    model = hf_model(family, "sdpa")
    sm = SlicedModel.from_model(model, seq_len=16, vocab=VOCAB)
    cm = GraphCostModel(PRESETS["a100"], GraphCosts.from_sliced(sm, float_bytes=4),
                        [(u, u + 1) for u in range(sm.num_units)])
    stage = sm.stage_module(1, 2)
    rt = StageRuntime(stage, 1.0, StagePrograms(stage))
    b, l = 2, 5
    y = rt.forward(0, 0, torch.randn(b, l, sm.hidden_size), 0, None)
    rt.backward_input(0, 0, torch.randn_like(y))
    kept = rt.held_bytes(0, 0)
    rt.backward_weight(0, 0)
    assert kept > 0 and kept == cm.held_grad_bytes(1, l, 0, b)


def test_a_version_4_profile_is_refused_as_stale(tiny_profile, tmp_path):
    """Version 4 did not measure the held gradients: a plan's memory would silently miss them."""
    import msgpack

    from tests.compiler.costmodel.tiny_model import refusals

    obj = msgpack.unpackb(tiny_profile["path"].read_bytes(), raw=False)
    obj["version"] = 4
    for u in obj["units"]:
        del u["held"], u["held_samples"]
    old = tmp_path / "v4.msgpack"
    old.write_bytes(msgpack.packb(obj, use_bin_type=True))
    for text in refusals(old):
        assert "stale" in text and "version 4" in text and "split backward keeps" in text
