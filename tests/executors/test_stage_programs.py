"""A stage's programs (tpc.compiler.programs.joint) give eager autograd's numbers, and their
split backward does the work of one backward, not two: the weight half starts from what the
input half held, so no activation gradient is computed twice; on every kind of stage."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.compiler.frontend.harness import tiny_model
from tpc.compiler.frontend import SlicedModel
from tpc.compiler.programs.stage_programs import StagePrograms
from tpc.executors.stage_runtime import StageRuntime

SEQ, LENS = 16, (5, 6, 5)
aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


class CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in GEMMS
        return func(*args, **(kwargs or {}))


def _run(stage, hidden, split: bool, programs: bool | None = None, vocab: int = 256):
    """Forward 3 slices, then backward (plain, or every input half then every weight half),
    eagerly under autograd or through the stage's programs (`programs`, default: when split);
    the parameter gradients, the input gradients and the GEMMs each phase ran."""
    torch.manual_seed(3)
    for p in stage.parameters():
        p.grad = None
    programs = split if programs is None else programs
    rt = StageRuntime(stage, 1.0, StagePrograms(stage) if programs else None)
    start = 0
    gouts = []
    for i, n in enumerate(LENS):
        x = torch.randint(0, vocab, (2, n)) if stage.is_first else torch.randn(2, n, hidden)
        targets = torch.randint(0, vocab, (2, n)) if stage.is_last else None
        rt.forward(0, i, x, start, targets, capacity=SEQ)
        gouts.append(None if stage.is_last else torch.randn(2, n, hidden))
        start += n
    count_in, count_w = CountGemms(), CountGemms()
    inputs = {}
    with count_in:
        for i in reversed(range(len(LENS))):
            inputs[i] = (rt.backward_input if split else rt.backward)(0, i, gouts[i])
    if split:
        with count_w:
            for i in reversed(range(len(LENS))):
                rt.backward_weight(0, i)
    assert rt.live_activations == 0
    return {n: p.grad.clone() for n, p in stage.named_parameters()}, inputs, count_in.n, count_w.n


def _check(sm, where: str, vocab: int = 256) -> None:
    n = sm.num_units
    lo, hi = {"first": (0, 2), "middle": (1, n - 1), "last": (n - 2, n), "whole": (0, n)}[where]
    stage = sm.stage_module(lo, hi)
    plain, plain_in, gemms, _ = _run(stage, sm.hidden_size, split=False, vocab=vocab)
    whole, whole_in, gemms_whole, _ = _run(stage, sm.hidden_size, split=False, programs=True, vocab=vocab)
    split, split_in, gemms_in, gemms_w = _run(stage, sm.hidden_size, split=True, vocab=vocab)
    assert set(split) == set(plain) == set(whole)
    for k in plain:  # the programs run the ops eager autograd runs: the same numbers, bitwise
        assert torch.equal(whole[k], plain[k]), k
        assert torch.equal(split[k], plain[k]), k
    for i in plain_in:
        if plain_in[i] is None:
            assert whole_in[i] is None and split_in[i] is None
        else:
            assert torch.equal(whole_in[i], plain_in[i]) and torch.equal(split_in[i], plain_in[i])
    assert gemms_w > 0
    assert gemms_in + gemms_w == gemms == gemms_whole  # nothing computed twice


@pytest.mark.parametrize("name", ["gpt", "llama", "nanogpt"])
@pytest.mark.parametrize("where", ["first", "middle", "last", "whole"])
def test_split_backward_is_one_backward(name, where):
    """examples/gpt.py, examples/llama.py (torchtitan's Llama: complex rotary table, grouped-query
    attention, SwiGLU) and examples/nanogpt.py (nanoGPT's model.py)."""
    _check(SlicedModel.from_model(tiny_model(name), seq_len=SEQ, vocab=256), where)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_hugging_face_decoders_split_as_autograd_does(family, where):
    """Code nobody here wrote: Hugging Face Llama and GPT-2 (Conv1D linears) from configs."""
    pytest.importorskip("transformers")
    from tests.compiler.frontend.hf_models import VOCAB, hf_model

    _check(SlicedModel.from_model(hf_model(family, "sdpa"), seq_len=SEQ, vocab=VOCAB), where, vocab=VOCAB)
