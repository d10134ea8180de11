"""No plan is written that cannot train. Writes into a tensor the forward makes with `copy_`
(DeepSeek-V3's latent attention fills `new_empty` keys by slices; a 40-line GPT written the same
way) become ops with a derivative, and are exact when sliced; the self-check runs the backward
too, so an op without a derivative is refused at its line, with weights and without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tpc.compiler.frontend import SlicedModel, functional, load_model
from tpc.compiler.frontend.backward_check import compare_gradients
from tpc.compiler.frontend.weightless import build_weightless
from tpc.executors.oracle import reference_step
from tpc.ir.diagnostics import TpirError

from .harness import batch, sliced_step, summed
from .hf_models import VOCAB, assert_grads_match, hf_model

GPT = str(Path(__file__).resolve().parent / "models" / "new_empty_writes.py")
SEQ, ROWS, MICROBATCHES = 16, 4, 2
SLICINGS = {"equal": [4, 4, 4, 4], "unequal": [5, 2, 9], "ones": [1, 1, 1, 13]}
_made: dict = {}


def _gpt():
    if "gpt" not in _made:
        torch.manual_seed(0)
        model = load_model(GPT)
        _made["gpt"] = model, SlicedModel.from_model(model, seq_len=SEQ, vocab=64)
    return _made["gpt"]


@pytest.fixture(scope="module", autouse=True)
def _drop():
    yield
    _made.clear()


def _exact(model, sm, vocab, stages, lens):
    ids, targets = batch(vocab, ROWS, SEQ, seed=3)
    loss, per_stage = sliced_step(sm, sm.partition_by_params(stages), ids, targets, MICROBATCHES, lens)
    ref_loss, ref = reference_step(model, ids, targets)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_grads_match(summed(per_stage), ref)


@pytest.mark.parametrize("slicing", list(SLICINGS))
@pytest.mark.parametrize("stages", [2, 3])
def test_keys_written_into_new_empty_are_exact(stages, slicing):
    model, sm = _gpt()
    targets = {n.target for n in sm.context.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.copy.default not in targets and torch.ops.aten.slice_scatter.default in targets
    _exact(model, sm, 64, stages, SLICINGS[slicing])


def _old_copy(graph, n, dst, src, add):
    return add(torch.ops.aten.copy.default, (dst, src), dst)  # functional copy: no derivative


def test_an_op_without_a_derivative_is_refused_by_the_self_check(monkeypatch, tmp_path):
    """The rewrite as it was (functional `copy`): the forward self-check passes, the backward
    refuses at the model's line that wrote, with weights (whole model) and without (unit by unit)."""
    monkeypatch.setattr(functional, "_copied", _old_copy)
    torch.manual_seed(0)
    with pytest.raises(TpirError) as whole:
        SlicedModel.from_model(load_model(GPT), seq_len=SEQ, vocab=64)
    text = str(whole.value)
    assert "new_empty_writes.py:24:" in text and "the plan cannot train: `copy`" in text and "no derivative" in text
    weightless = SlicedModel.from_model(build_weightless(GPT)[0], seq_len=SEQ, vocab=None, check_slices=None)
    with pytest.raises(TpirError) as units:
        weightless.check_slicings([[5, 2, 9]])
    assert "new_empty_writes.py:24:" in str(units.value) and "no derivative" in str(units.value)


def test_a_gradient_that_differs_is_refused_naming_the_parameter():
    ref = {"w": torch.ones(3), "b": torch.zeros(2)}
    compare_gradients({"w": torch.ones(3) + 1e-6, "b": torch.zeros(2)}, ref, "unit 'x'")
    with pytest.raises(TpirError) as e:
        compare_gradients({"w": torch.ones(3), "b": torch.tensor([0.0, 0.5])}, ref, "unit 'x'")
    assert "slicing changes the gradient of `b`" in str(e.value)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_deepseek_v3_latent_attention_is_exact(impl):
    pytest.importorskip("transformers")
    model = hf_model("deepseek_v3", impl)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    for stages in (2, 3):
        for lens in SLICINGS.values():
            _exact(model, sm, VOCAB, stages, lens)


@pytest.mark.parametrize("family,impl", [("gemma2", "eager"), ("llama4_text", "sdpa"), ("mixtral", "sdpa"),
                                         ("gpt_oss", "eager")])
def test_the_new_families_recompute_and_split_their_backward_exactly(family, impl):
    """Soft-capping, chunked attention, experts and sinks under checkpointed slices (the
    forward run again before the backward) and a split backward (input half, then weights)."""
    pytest.importorskip("transformers")
    model = hf_model(family, impl)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    ids, targets = batch(VOCAB, ROWS, SEQ, seed=3)
    ref_loss, ref = reference_step(model, ids, targets)
    for checkpoint, split in ((True, False), (False, True), (True, True)):
        loss, per_stage = sliced_step(sm, sm.partition_by_params(2), ids, targets, MICROBATCHES, [3, 6, 7],
                                      checkpoint=checkpoint, split_backward=split)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        assert_grads_match(summed(per_stage), ref)
