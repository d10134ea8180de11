"""Split backward does the work of one backward, not two: the weight half starts from the
gradients the input half left at the intermediates, so no activation gradient is computed
twice; and the gradients are those of a plain backward, on every kind of stage."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.compiler.frontend.harness import tiny_model
from tpc.compiler.frontend import SlicedModel
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


def _run(stage, hidden, split: bool):
    """Forward 3 slices, then backward (plain, or every input half then every weight half);
    the parameter gradients and the GEMMs each phase ran."""
    torch.manual_seed(3)
    for p in stage.parameters():
        p.grad = None
    rt = StageRuntime(stage, 1.0)
    start = 0
    gouts = []
    for i, n in enumerate(LENS):
        x = torch.randint(0, 256, (2, n)) if stage.is_first else torch.randn(2, n, hidden)
        targets = torch.randint(0, 256, (2, n)) if stage.is_last else None
        rt.forward(0, i, x, start, targets, capacity=SEQ)
        gouts.append(None if stage.is_last else torch.randn(2, n, hidden))
        start += n
    count_in, count_w = CountGemms(), CountGemms()
    with count_in:
        for i in reversed(range(len(LENS))):
            (rt.backward_input if split else rt.backward)(0, i, gouts[i])
    if split:
        with count_w:
            for i in reversed(range(len(LENS))):
                rt.backward_weight(0, i)
    assert rt.live_activations == 0
    return {n: p.grad.clone() for n, p in stage.named_parameters()}, count_in.n, count_w.n


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("where", ["first", "middle", "last", "whole"])
def test_split_backward_is_one_backward(name, where):
    sm = SlicedModel.from_model(tiny_model(name), seq_len=SEQ, vocab=256)
    n = sm.num_units
    lo, hi = {"first": (0, 2), "middle": (1, n - 1), "last": (n - 2, n), "whole": (0, n)}[where]
    stage = sm.stage_module(lo, hi)
    plain, gemms, _ = _run(stage, sm.hidden_size, split=False)
    split, gemms_in, gemms_w = _run(stage, sm.hidden_size, split=True)
    assert set(split) == set(plain)
    for k in plain:
        torch.testing.assert_close(split[k], plain[k], rtol=1e-5, atol=1e-7, msg=k)
    assert gemms_w > 0
    assert gemms_in + gemms_w == gemms  # nothing computed twice
