"""A tiny causal LM whose "KV cache" is a running sum, with a stage runtime of the same interface
as `tpc.executors.stage_runtime.StageRuntime`, and a builder of plans for it.

It lets the engine and the interpreter be tested on their own, independent of the front end: the
running sum mixes every earlier token into each later one exactly as attention's keys and values
do, so a wrong slice order, a lost carry gradient or a misrouted message changes the gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule
from tpc.cli.compile import parse_slices
from tpc.compiler.optimise.slicing import equal_slices, ranges_of
from tpc.executors.engine import BuiltStage
from tpc.ir.nodes import (
    Header,
    MeshLine,
    Microbatch,
    ModelLine,
    ScheduleLine,
    ShapeLine,
    Stage,
    Tie,
    UnitsLine,
)

VOCAB, HIDDEN = 11, 8


class Layer(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(h, h) / h**0.5)
        self.a = nn.Parameter(torch.randn(h, h) / h**0.5)
        self.b = nn.Parameter(torch.randn(h) * 0.1)

    def forward(self, x, carry):  # x (B, T, H), carry (B, H): sum of earlier tokens' x @ a
        run = carry[:, None, :] + torch.cumsum(x @ self.a, dim=1)  # (B, T, H)
        return torch.tanh(x @ self.w + run / (1 + run.abs()) + self.b), run[:, -1, :]


class FakeLM(nn.Module):
    """Units: 0 embedding, 1..n layers, n+1 head. `tie=True` reuses the embedding in the head."""

    def __init__(self, n_layer: int = 2, tie: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer(HIDDEN) for _ in range(n_layer))
        self.tie = tie
        if not tie:
            self.head = nn.Parameter(torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5)
        self.units = n_layer + 2

    def head_weight(self):
        return self.embed.weight if self.tie else self.head

    def forward(self, ids):
        x = self.embed(ids)
        carry = torch.zeros(ids.shape[0], HIDDEN)
        for layer in self.layers:
            x, _ = layer(x, carry)
        return x @ self.head_weight().t()

    def unit_params(self, lo: int, hi: int) -> list[tuple[str, nn.Parameter]]:
        out = []
        for name, p in self.named_parameters():
            unit = 0 if name.startswith("embed") else self.units - 1 if name == "head" else int(name.split(".")[1]) + 1
            if lo <= unit < hi:
                out.append((name, p))
        if self.tie and lo <= self.units - 1 < hi and lo > 0:
            out.append(("embed.weight", self.embed.weight))
        return out


def reference(model: FakeLM, tokens: torch.Tensor):
    """Loss and gradients of plain autograd on the unsliced model (mean over all tokens)."""
    model.zero_grad(set_to_none=True)
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


class FakeRuntime:
    """Runs units [lo, hi) of a FakeLM one token slice at a time, caching each layer's carry."""

    def __init__(self, model: FakeLM, lo: int, hi: int, loss_scale: float):
        self.model, self.lo, self.hi, self.scale = model, lo, hi, loss_scale
        self.first, self.last = lo == 0, hi == model.units
        self.layers = [model.layers[u - 1] for u in range(max(lo, 1), min(hi, model.units - 1))]
        self.carry: dict[int, list[torch.Tensor]] = {}  # mb -> carry after the last forwarded slice
        self.carry_grad: dict[tuple[int, int], list[torch.Tensor]] = {}  # grads of (mb, sl)'s carries
        self.saved: dict[tuple[int, int], tuple] = {}  # live autograd graphs
        self.inputs: dict[tuple[int, int], tuple] = {}  # what a checkpointed slice needs again
        self.split: dict[tuple[int, int], tuple] = {}  # after backward-input: outputs for backward-weight

    @property
    def live_activations(self) -> int:
        return len(self.saved) + len(self.split)

    def _run(self, mb, sl, x, carries, targets):
        x_in = x if self.first else x.detach().requires_grad_()
        leaves = [c.detach().requires_grad_() for c in carries]
        h = self.model.embed(x_in) if self.first else x_in
        outs = []
        for layer, c in zip(self.layers, leaves):
            h, c_out = layer(h, c)
            outs.append(c_out)
        if self.last:
            logits = h @ self.model.head_weight().t()
            h = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum") * self.scale
        return x_in, leaves, h, outs

    def forward(self, mb, sl, x, offset, targets=None, checkpoint=False, capacity=None):
        # `capacity` sizes a KV buffer; the carries here are one fixed-size state per layer
        zeros = [torch.zeros(x.shape[0], HIDDEN) for _ in self.layers]
        carries = zeros if sl == 0 else self.carry[mb]
        if checkpoint:
            with torch.no_grad():
                _, _, out, outs = self._run(mb, sl, x, carries, targets)
            self.inputs[(mb, sl)] = (x, carries, targets)
        else:
            x_in, leaves, out, outs = self._run(mb, sl, x, carries, targets)
            self.saved[(mb, sl)] = (x_in, leaves, out, outs)
        self.carry[mb] = [c.detach() for c in outs]
        return out.detach()

    def recompute(self, mb, sl):
        x, carries, targets = self.inputs.pop((mb, sl))
        self.saved[(mb, sl)] = self._run(mb, sl, x, carries, targets)

    def _outputs(self, mb, sl, grad_out):
        x_in, leaves, out, outs = self.saved.pop((mb, sl))
        cg = self.carry_grad.pop((mb, sl), None) or [torch.zeros_like(c) for c in outs]
        g = torch.ones_like(out) if self.last else grad_out
        return x_in, leaves, [out, *outs], [g, *cg]

    def backward(self, mb, sl, grad_out=None):
        x_in, leaves, tensors, grads = self._outputs(mb, sl, grad_out)
        torch.autograd.backward(tensors, grads)
        if sl > 0:
            self.carry_grad[(mb, sl - 1)] = [c.grad for c in leaves]
        return None if self.first else x_in.grad

    def backward_input(self, mb, sl, grad_out=None):
        x_in, leaves, tensors, grads = self._outputs(mb, sl, grad_out)
        inputs = ([] if self.first else [x_in]) + leaves
        got = torch.autograd.grad(tensors, inputs, grads, retain_graph=True)
        if sl > 0:
            self.carry_grad[(mb, sl - 1)] = list(got[len(got) - len(leaves):])
        self.split[(mb, sl)] = (tensors, grads)
        return None if self.first else got[0]

    def backward_weight(self, mb, sl):
        tensors, grads = self.split.pop((mb, sl))
        params = [p for _, p in self.named_parameters()]
        torch.autograd.backward(tensors, grads, inputs=params)

    def free_kv(self, mb):
        self.carry.pop(mb, None)
        for k in [k for k in self.carry_grad if k[0] == mb]:
            del self.carry_grad[k]

    def named_parameters(self):
        return self.model.unit_params(self.lo, self.hi)


def fake_factory(model_copy: FakeLM):
    def build(stage: Stage, loss_scale: float) -> BuiltStage:
        rt = FakeRuntime(model_copy, stage.units[0], stage.units[1], loss_scale)
        return BuiltStage(rt, rt.named_parameters())

    return build


def fake_header(*, schedule: str, stages: int = 2, ranks: list[int] | None = None, microbatches: int = 1,
                slices: str = "1", batch: int = 4, seq: int = 12, dp: int = 1, n_layer: int = 2,
                tie: bool = False) -> Header:
    """The header of a plan for FakeLM; stage s on rank `ranks[s]` (default s), units split evenly."""
    units = n_layer + 2
    ranks = ranks if ranks is not None else list(range(stages))
    cuts = [round(units * s / stages) for s in range(stages + 1)]
    per_replica = batch // dp
    sizes = [per_replica // microbatches + (1 if m < per_replica % microbatches else 0) for m in range(microbatches)]
    spec = parse_slices(slices, seq)
    cut = equal_slices(spec, seq) if isinstance(spec, int) else ranges_of(spec)
    return Header(
        model=ModelLine(path="fake.py", sha256="0" * 64),
        shape=ShapeLine(batch=batch, seq=seq, vocab=VOCAB),
        mesh=MeshLine(pipe=max(ranks) + 1, data=dp),
        schedule=ScheduleLine(name=schedule),
        units=UnitsLine(count=units),
        stages=tuple(Stage(index=s, rank=ranks[s], units=(cuts[s], cuts[s + 1])) for s in range(stages)),
        microbatches=tuple(Microbatch(index=m, size=n, slices=cut) for m, n in enumerate(sizes)),
        ties=(Tie(name="embed.weight", stages=(0, stages - 1)),) if tie and stages > 1 else (),
    )


def fake_plan(*, exchanges: str = "batched", **kw):
    """The verified plan of `fake_header(**kw)`, its NCCL exchanges lowered `exchanges`."""
    header = fake_header(**kw)
    return lower(header, build_schedule(header.schedule.name, header), exchanges=exchanges)
