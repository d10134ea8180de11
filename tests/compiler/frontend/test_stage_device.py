"""A stage moves to a device whole: its parameters, buffers and the tensor constants export
lifted out of the model's forward (a non-scalar literal such as `torch.tensor([...])`), which
would otherwise stay on the CPU and fail with a device mismatch on CUDA."""

from __future__ import annotations

import torch
import torch.nn as nn

from tpc.compiler.frontend import SlicedModel

SCALES = [0.5, 1.0, 1.5, 2.0, 0.5, 1.0, 1.5, 2.0]


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.fc = nn.Linear(h, h)

    def forward(self, x):
        return x + self.fc(x) * torch.tensor(SCALES)  # a literal: a lifted tensor constant


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(11, 8)
        self.h = nn.ModuleList(Block(8) for _ in range(2))
        self.head = nn.Linear(8, 11, bias=False)

    def forward(self, ids):
        x = self.wte(ids)
        for b in self.h:
            x = b(x)
        return self.head(x)


def _tensors(module: nn.Module):
    """Every tensor a module tree holds: parameters, buffers and plain tensor attributes."""
    for name, mod in module.named_modules():
        for field, value in vars(mod).items():
            if isinstance(value, torch.Tensor):
                yield f"{name}.{field}", value
        yield from ((f"{name}.{n}", t) for n, t in mod.named_parameters(recurse=False))
        yield from ((f"{name}.{n}", t) for n, t in mod.named_buffers(recurse=False))


def test_lifted_constants_follow_the_stage_to_meta():
    torch.manual_seed(0)
    sliced = SlicedModel.from_model(LM(), seq_len=8, vocab=11)
    for lo in range(sliced.num_units):
        stage = sliced.stage_module(lo, sliced.num_units)
        consts = [n for n, _ in stage.named_buffers() if "lifted_tensor" in n]
        if lo <= 1:
            assert consts, "the literal is a constant of the stage"
        stage.to("meta")
        held = dict(_tensors(stage))
        assert held, lo
        off = {n: t.device for n, t in held.items() if t.device.type != "meta"}
        assert not off, off
        # every tensor the graph reads is one the module holds (so `.to` reached it)
        targets = [n.target for n in stage.graph.nodes if n.op == "get_attr"]
        assert targets
        for t in targets:
            value = stage.get_submodule(t.rsplit(".", 1)[0]) if "." in t else stage
            assert getattr(value, t.rsplit(".", 1)[-1]).device.type == "meta", t
