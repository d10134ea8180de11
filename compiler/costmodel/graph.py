"""`GraphCostModel`: the roofline of a device applied to the traced graph's own op counts.

The front end counts every op of the sliced graph (`frontend/flops.py`): FLOPs, bytes and
kernel launches per partition unit as functions of the slice length `l`, the cached context
`c` and the micro-batch rows `b`, forward and backward. With a `DeviceSpec` a unit's time is

    kernels * launch_overhead + sum over op classes (matmul, attention, memory) of
        max(FLOPs / (peak * flops_efficiency), bytes / (bandwidth * mem_efficiency))

and a stage's time is the longer of the sum of its units' and of the host's time to issue
their kernels (kernels * host_op_time: eager PyTorch dispatches every kernel from Python, ahead
of the GPU; a short slice of a small model waits on the host, docs/costmodel.md). The roofline
is taken per op class rather than per kernel: the kernels of one class in one unit see the same
token count and so about the same arithmetic intensity, and three sums per unit evaluate much
faster than one maximum per node over the optimiser's hundreds of thousands of slices. Memory sizes (activations, KV
cache, parameters, what a forward keeps for its backward) come from the graph's shapes too.

Floating-point values count `float_bytes` each (2: the device presets quote bf16/fp16
tensor-core peaks, so they price a mixed-precision run; the plan itself may run in float32).

Split over a tensor group of T ranks (`tensor`, `tpc compile --tensor T`: Megatron's split,
docs/parallelism.md), each rank runs every kernel of the stage on 1/T of the work: the FLOPs and
bytes of every op class are divided by T (the matmuls and attention by heads, and the elementwise
kernels, most of which act on split values; the norms and residual adds, which stay whole, are
counted split too: an approximation that flatters small widths), the kernel count is not, and the
group's all-reduces are added (`base.tensor_allreduces`: two per decoder layer -- a unit's
caches count its attention layers -- in each direction, and one for the vocabulary-parallel
embedding of the first unit), each priced by `DeviceSpec.group_allreduce_time` on the node's
link, the formula the analytic model uses. Parameters, gradients, the KV cache and what a
forward keeps are divided by T; the activation a stage sends is the whole one (every rank of
the group holds it after the all-reduce).

This is what `tpc compile/simulate --device-model` use: it works for any model the front end
can capture. `AnalyticCostModel` is the same roofline over a GPT block written out by hand
from `ModelShapes`, for models too large to build (bench/paper_table.py prices 175B models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tpc.compiler.costmodel.base import tensor_allreduces
from tpc.compiler.costmodel.on_device import DeviceCostModel
from tpc.compiler.costmodel.devices import DeviceSpec
from tpc.compiler.costmodel.documents import attention_share
from tpc.compiler.costmodel.dropped import DroppedUnitCostFn
from tpc.compiler.costmodel.source import CostSource
from tpc.compiler.frontend.flops import CLASSES, UnitCostFn
from tpc.compiler.frontend.ssm_state import STATE


@dataclass(frozen=True)
class GraphCosts:
    """What the cost model needs from a traced model, gathered once for every partition."""

    unit_fns: tuple[UnitCostFn, ...]
    hidden: int  # width of the residual stream a stage sends on
    kv_elements: tuple[int, ...]  # per unit, KV elements per token of one sequence
    param_count: Callable[[int, int], int]  # distinct parameters of units [lo, hi)
    float_bytes: int = 2
    name: str = ""
    # per unit, its caches as (elements per token, sliding window or None); empty: all full
    kv_caches: tuple = ()
    # packed documents: the corpus's mean document length, which attention is priced by
    # (`documents.attention_share`); None: each row is one text
    document_length: int | None = None
    # random-LTD: per dropped unit, the fraction of tokens it keeps (`dropped.py`: its work,
    # KV cache and stash priced at that many tokens); empty: every unit runs every token
    kept: tuple = ()

    def unit_layers(self, unit: int) -> int:
        """The attention layers of a unit (its caches; 1 for a unit with KV elements but no
        cache list): what the tensor group's all-reduces are counted by."""
        if self.kv_caches:
            return len(self.kv_caches[unit])
        return int(self.kv_elements[unit] > 0)

    @classmethod
    def from_sliced(cls, sliced, float_bytes: int = 2, name: str = "",
                    document_length: int | None = None, kept=None) -> "GraphCosts":
        """`kept`: {unit: fraction of its tokens} of the units that drop tokens (random-LTD)."""
        fns = list(sliced.unit_cost_fns(float_bytes))
        kv = list(sliced.unit_kv_elements)
        caches = [tuple(c) for c in sliced.unit_kv]
        kept = dict(kept or {})
        for u, f in kept.items():
            fns[u] = DroppedUnitCostFn(fns[u], f, int(sliced.hidden_size), int(float_bytes))
            kv[u] = kv[u] * f  # a dropped unit caches its kept tokens only
            if u < len(caches):
                caches[u] = tuple((e * f, w) for e, w in caches[u])
        return cls(tuple(fns), int(sliced.hidden_size), tuple(kv), sliced.stage_param_count, int(float_bytes),
                   name or type(sliced.model).__name__, tuple(caches), document_length,
                   tuple(sorted(kept.items())))

    @property
    def num_units(self) -> int:
        return len(self.unit_fns)


class GraphCostModel(DeviceCostModel):
    """CostModel of the stages `stage_units` ([lo, hi) unit ranges) of a traced model on
    `device` GPUs, `tensor` GPUs per stage (its tensor group, the module docstring), consecutive
    stages on consecutive GPUs of a node."""

    def __init__(self, device: DeviceSpec, costs: GraphCosts, stage_units, tensor: int = 1):
        if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1:
            raise ValueError(f"tensor degree must be a positive whole number, got {tensor!r}")
        ranges = tuple((int(lo), int(hi)) for lo, hi in stage_units)
        ends = [0] + [hi for _, hi in ranges]
        if not ranges or ends[-1] != costs.num_units or any(
                lo != prev or lo >= hi for (lo, hi), prev in zip(ranges, ends)):
            raise ValueError(f"stage unit ranges {ranges} do not cover units 0:{costs.num_units} in order")
        self.device, self.costs, self.stage_units = device, costs, ranges
        self.op = tensor  # the GPUs of a stage (DeviceCostModel: which boundaries cross a node)
        self.num_stages = len(ranges)
        self._params = [costs.param_count(lo, hi) for lo, hi in ranges]

    @property
    def tensor(self) -> int:
        return self.op

    # ------------------------------------------------------------------------ roofline

    def _unit_times(self, fn: UnitCostFn, l, c, b, allreduces=(0, 0)):
        """(forward GPU s, backward GPU s, forward kernels, backward kernels) of one unit on one
        rank of its tensor group, with `allreduces` (forward, backward) of the group's
        all-reduces of the activation (none without a tensor axis)."""
        d, T = self.device, self.op
        peak = d.peak_flops * d.flops_efficiency * T  # 1/T of the work on each rank
        bw = d.mem_bandwidth * d.mem_efficiency * T
        cost = fn(l, c, b)
        if self.costs.document_length is not None:  # packed documents: only each document's scores
            share = attention_share(l, c, self.costs.document_length)
            for work in (cost.fwd, cost.bwd):
                a = work["attention"]
                work["attention"] = type(a)(a.flops * share, a.bytes * share, a.kernels)
        one = d.group_allreduce_time(np.asarray(l, dtype=np.float64) * b * self.costs.hidden
                                     * self.costs.float_bytes, T) if T > 1 else 0.0
        out = []
        for work, n in zip((cost.fwd, cost.bwd), allreduces):
            t = sum(np.maximum(work[k].flops / peak, work[k].bytes / bw) for k in CLASSES)
            kernels = sum(work[k].kernels for k in CLASSES)
            # (group_allreduce_time includes each collective's launch)
            out.append((t + kernels * d.launch_overhead + n * one, kernels + n))
        return out[0][0], out[1][0], out[0][1], out[1][1]

    def _allreduces(self, unit: int) -> tuple[int, int]:
        """The tensor group's (forward, backward) all-reduces in `unit` (the module docstring)."""
        return tensor_allreduces(self.costs.unit_layers(unit), unit == 0, self.op)

    def slice_times(self, stage, l, c, mb):
        """(forward, backward) seconds of slices on `stage` (numpy arrays broadcast): each the
        longer of the GPU's time and the host's (`DeviceSpec.host_op_time` per kernel), which
        dispatches ahead of the GPU through the whole stage."""
        lo, hi = self.stage_units[stage]
        memo: dict[tuple, tuple] = {}  # identical blocks are priced once
        f = b = kf = kb = 0.0
        for u in range(lo, hi):
            fn, ars = self.costs.unit_fns[u], self._allreduces(u)
            if (fn.signature, ars) not in memo:
                memo[fn.signature, ars] = self._unit_times(fn, l, c, mb, ars)
            uf, ub, ukf, ukb = memo[fn.signature, ars]
            f, b, kf, kb = f + uf, b + ub, kf + ukf, kb + ukb
        host = self.device.host_op_time
        return np.maximum(f, kf * host), np.maximum(b, kb * host)

    def slice_time(self, stage: int, l: int, c: int, mb_size: int) -> tuple[float, float]:
        f, b = self.slice_times(stage, l, c, mb_size)
        return float(f), float(b)

    def distinct_stages(self) -> tuple[int, ...]:
        """One stage per distinct sequence of units (the same blocks cost the same)."""
        seen: dict[tuple, int] = {}
        for s, (lo, hi) in enumerate(self.stage_units):
            key = tuple((self.costs.unit_fns[u].signature, self._allreduces(u)) for u in range(lo, hi))
            seen.setdefault(key, s)
        return tuple(sorted(seen.values()))

    # ------------------------------------------------------------------------ memory

    def activation_bytes(self, l: int, mb_size: int) -> int:
        return int(l * mb_size * self.costs.hidden * self.costs.float_bytes)

    def activation_bytes_array(self, l, mb):
        return np.asarray(l, dtype=np.float64) * mb * self.costs.hidden * self.costs.float_bytes

    def kv_bytes(self, stage: int, l: int, mb_size: int) -> int:
        """The rank's heads of the cache: 1/T of it (module docstring)."""
        lo, hi = self.stage_units[stage]
        return int(sum(self.costs.kv_elements[lo:hi]) * l * mb_size * self.costs.float_bytes / self.op)

    def kv_slice_bytes(self, stage: int, lengths, mb_size: int) -> list[int]:
        """KV-cache bytes charged to each slice of a micro-batch of slices `lengths`: a full
        cache grows with every token; a sliding-window layer's (window w) holds at most its last
        w - 1 tokens plus the slice being appended, min(T, w - 1 + longest slice) tokens in all,
        charged to the first slices. A state-space scan's carried state (`STATE`) is held
        twice at most, the last slice's and the one being written, whatever the tokens."""
        lo, hi = self.stage_units[stage]
        caches = self.costs.kv_caches[lo:hi] if self.costs.kv_caches else ()
        if not caches:
            return [self.kv_bytes(stage, n, mb_size) for n in lengths]
        lengths = [int(n) for n in lengths]
        total, longest = sum(lengths), max(lengths, default=0)
        out = [0.0] * len(lengths)
        for unit in caches:
            for elements, window in unit:
                if window == STATE:  # a scan's state: the last slice's, and the one being written
                    for j in range(min(len(lengths), 2)):
                        out[j] += elements
                    continue
                held = total if window is None else min(total, window - 1 + longest)
                left = held
                for j, n in enumerate(lengths):
                    tokens = n if window is None else min(n, left)
                    left -= tokens
                    out[j] += elements * tokens
        scale = mb_size * self.costs.float_bytes / self.op
        return [int(x * scale) for x in out]

    def stash_bytes(self, stage: int, l: int, c: int, mb_size: int) -> int:
        """Bytes the forward's ops leave allocated (their outputs), kept for the backward."""
        lo, hi = self.stage_units[stage]
        return int(sum(float(fn(l, c, mb_size).stash) for fn in self.costs.unit_fns[lo:hi]) / self.op)

    def held_grad_bytes(self, stage: int, l: int, c: int, mb_size: int) -> int:
        """What a split backward keeps between its halves: the output gradients of the stage's
        ops that join a parameter with an activation (flops.py, `_held`)."""
        lo, hi = self.stage_units[stage]
        return int(sum(float(fn(l, c, mb_size).held) for fn in self.costs.unit_fns[lo:hi]) / self.op)

    def param_bytes(self, stage: int) -> int:
        return int(self._params[stage] * self.costs.float_bytes / self.op)

    # ------------------------------------------------------------------------ links

    def describe(self) -> str:
        c = self.costs
        return (f"analytic {self.device.name} from the traced graph of {c.name}: {c.num_units} units, "
                f"stages {self.num_stages}, {8 * c.float_bytes}-bit floats"
                + (f", tensor {self.op}" if self.op > 1 else "")
                + (", random-LTD keeping " + ", ".join(f"{f:.0%} in unit {u}" for u, f in c.kept) if c.kept else ""))


def graph_cost_source(sliced, device: DeviceSpec, float_bytes: int = 2, tensor: int = 1,
                      document_length: int | None = None, kept=None) -> CostSource:
    """A CostSource pricing any partition of `sliced` (a SlicedModel) on `device`, each stage
    split over `tensor` ranks (`CostSource.split` gives the same for another degree);
    `document_length`: over packed documents of that mean length; `kept`: {unit: fraction} of
    the units that drop tokens (random-LTD, `dropped.py`)."""
    costs = GraphCosts.from_sliced(sliced, float_bytes, document_length=document_length, kept=kept)
    return CostSource(costs.num_units, lambda ranges, t: GraphCostModel(device, costs, ranges, t), tensor)
