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

This is what `tpc compile/simulate --device-model` use: it works for any model the front end
can capture. `AnalyticCostModel` is the same roofline over a GPT block written out by hand
from `ModelShapes`, for models too large to build (bench/paper_table.py prices 175B models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tpc.compiler.costmodel.on_device import DeviceCostModel
from tpc.compiler.costmodel.devices import DeviceSpec
from tpc.compiler.costmodel.source import CostSource
from tpc.compiler.frontend.flops import CLASSES, UnitCostFn


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

    @classmethod
    def from_sliced(cls, sliced, float_bytes: int = 2, name: str = "") -> "GraphCosts":
        return cls(tuple(sliced.unit_cost_fns(float_bytes)), int(sliced.hidden_size),
                   tuple(sliced.unit_kv_elements), sliced.stage_param_count, int(float_bytes),
                   name or type(sliced.model).__name__,
                   tuple(tuple(caches) for caches in sliced.unit_kv))

    @property
    def num_units(self) -> int:
        return len(self.unit_fns)


class GraphCostModel(DeviceCostModel):
    """CostModel of the stages `stage_units` ([lo, hi) unit ranges) of a traced model on
    `device` GPUs, one GPU per stage, consecutive stages on consecutive GPUs of a node."""

    def __init__(self, device: DeviceSpec, costs: GraphCosts, stage_units):
        ranges = tuple((int(lo), int(hi)) for lo, hi in stage_units)
        ends = [0] + [hi for _, hi in ranges]
        if not ranges or ends[-1] != costs.num_units or any(
                lo != prev or lo >= hi for (lo, hi), prev in zip(ranges, ends)):
            raise ValueError(f"stage unit ranges {ranges} do not cover units 0:{costs.num_units} in order")
        self.device, self.costs, self.stage_units = device, costs, ranges
        self.num_stages = len(ranges)
        self._params = [costs.param_count(lo, hi) for lo, hi in ranges]

    # ------------------------------------------------------------------------ roofline

    def _unit_times(self, fn: UnitCostFn, l, c, b):
        """(forward GPU s, backward GPU s, forward kernels, backward kernels) of one unit."""
        d = self.device
        peak = d.peak_flops * d.flops_efficiency
        bw = d.mem_bandwidth * d.mem_efficiency
        cost = fn(l, c, b)
        out = []
        for work in (cost.fwd, cost.bwd):
            t = sum(np.maximum(work[k].flops / peak, work[k].bytes / bw) for k in CLASSES)
            kernels = sum(work[k].kernels for k in CLASSES)
            out.append((t + kernels * d.launch_overhead, kernels))
        return out[0][0], out[1][0], out[0][1], out[1][1]

    def slice_times(self, stage, l, c, mb):
        """(forward, backward) seconds of slices on `stage` (numpy arrays broadcast): each the
        longer of the GPU's time and the host's (`DeviceSpec.host_op_time` per kernel), which
        dispatches ahead of the GPU through the whole stage."""
        lo, hi = self.stage_units[stage]
        memo: dict[tuple, tuple] = {}  # identical blocks are priced once
        f = b = kf = kb = 0.0
        for fn in self.costs.unit_fns[lo:hi]:
            if fn.signature not in memo:
                memo[fn.signature] = self._unit_times(fn, l, c, mb)
            uf, ub, ukf, ukb = memo[fn.signature]
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
            key = tuple(fn.signature for fn in self.costs.unit_fns[lo:hi])
            seen.setdefault(key, s)
        return tuple(sorted(seen.values()))

    # ------------------------------------------------------------------------ memory

    def activation_bytes(self, l: int, mb_size: int) -> int:
        return int(l * mb_size * self.costs.hidden * self.costs.float_bytes)

    def activation_bytes_array(self, l, mb):
        return np.asarray(l, dtype=np.float64) * mb * self.costs.hidden * self.costs.float_bytes

    def kv_bytes(self, stage: int, l: int, mb_size: int) -> int:
        lo, hi = self.stage_units[stage]
        return int(sum(self.costs.kv_elements[lo:hi]) * l * mb_size * self.costs.float_bytes)

    def kv_slice_bytes(self, stage: int, lengths, mb_size: int) -> list[int]:
        """KV-cache bytes charged to each slice of a micro-batch of slices `lengths`: a full
        cache grows with every token; a sliding-window layer's (window w) holds at most its last
        w - 1 tokens plus the slice being appended, min(T, w - 1 + longest slice) tokens in all,
        charged to the first slices."""
        lo, hi = self.stage_units[stage]
        caches = self.costs.kv_caches[lo:hi] if self.costs.kv_caches else ()
        if not caches:
            return [self.kv_bytes(stage, n, mb_size) for n in lengths]
        lengths = [int(n) for n in lengths]
        total, longest = sum(lengths), max(lengths, default=0)
        out = [0.0] * len(lengths)
        for unit in caches:
            for elements, window in unit:
                held = total if window is None else min(total, window - 1 + longest)
                left = held
                for j, n in enumerate(lengths):
                    tokens = n if window is None else min(n, left)
                    left -= tokens
                    out[j] += elements * tokens
        scale = mb_size * self.costs.float_bytes
        return [int(x * scale) for x in out]

    def stash_bytes(self, stage: int, l: int, c: int, mb_size: int) -> int:
        """Bytes the forward's ops leave allocated (their outputs), kept for the backward."""
        lo, hi = self.stage_units[stage]
        return int(sum(float(fn(l, c, mb_size).stash) for fn in self.costs.unit_fns[lo:hi]))

    def held_grad_bytes(self, stage: int, l: int, c: int, mb_size: int) -> int:
        """What a split backward keeps between its halves: the output gradients of the stage's
        ops that join a parameter with an activation (flops.py, `_held`)."""
        lo, hi = self.stage_units[stage]
        return int(sum(float(fn(l, c, mb_size).held) for fn in self.costs.unit_fns[lo:hi]))

    def param_bytes(self, stage: int) -> int:
        return int(self._params[stage] * self.costs.float_bytes)

    # ------------------------------------------------------------------------ links

    def describe(self) -> str:
        c = self.costs
        return (f"analytic {self.device.name} from the traced graph of {c.name}: {c.num_units} units, "
                f"stages {self.num_stages}, {8 * c.float_bytes}-bit floats")


def graph_cost_source(sliced, device: DeviceSpec, float_bytes: int = 2) -> CostSource:
    """A CostSource pricing any partition of `sliced` (a SlicedModel) on `device`."""
    costs = GraphCosts.from_sliced(sliced, float_bytes)
    return CostSource(costs.num_units, lambda ranges: GraphCostModel(device, costs, ranges))
