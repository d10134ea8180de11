"""Where slicing changes a model: the first value of the captured graph whose sliced value
differs from its unsliced one.

Used when the numeric self-check fails. The captured graph (before any pass) is run at the full
length, and the whole sliced model slice by slice, both keeping every value; a value of the
sliced graph that has one token axis is its slices joined along that axis, and is compared with
the captured value of the same node. The first node, in graph order, that differs is where the
model mixes tokens in a way the passes did not see (a position computed from the data, a shift
along the sequence, ...), and its source line is what the refusal shows.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from tpc.compiler.frontend.axes import node_token_axes


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[str, object] = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _module_for(graph: fx.Graph, fetch) -> fx.GraphModule:
    root = nn.Module()
    for n in graph.nodes:
        if n.op == "get_attr":
            *path, leaf = n.target.split(".")
            mod = root
            for p in path:
                if not hasattr(mod, p):
                    mod.add_module(p, nn.Module())
                mod = getattr(mod, p)
            value = fetch(n.target)
            if isinstance(value, nn.Parameter):
                mod.register_parameter(leaf, value)
            elif isinstance(value, torch.Tensor):
                mod.register_buffer(leaf, value)
            else:
                setattr(mod, leaf, value)
    return fx.GraphModule(root, graph)


def first_difference(captured: fx.Graph, fetch, seq_sym, ids: torch.Tensor, lens, stage) -> fx.Node | None:
    """The first node of `captured` (the graph before any pass; `fetch(name)` gives its
    attributes, `seq_sym` is its sequence length) whose value the sliced run of `stage` (every
    unit, no loss) on `ids` with slices `lens` changes, or None."""
    with torch.no_grad():
        whole = _Recorder(_module_for(captured, fetch))
        whole.run(ids)
    return first_difference_of(captured, whole.values, seq_sym, ids, lens, stage)


def first_difference_of(captured: fx.Graph, values: dict, seq_sym, x: torch.Tensor, lens, stage) -> fx.Node | None:
    """`first_difference` given the unsliced values of `captured`'s nodes by name (`values`; a
    part of the graph will do: the unit-by-unit self-check's), `stage` run on `x` (the ids, or
    the residual stream entering its first unit) with slices `lens`."""
    with torch.no_grad():
        sliced = _Recorder(fx.GraphModule(stage, stage.graph))
        per_slice: dict[str, list] = {}
        kv_parts: list[list] = [[] for _ in range(stage.num_kv)]
        off = 0
        for ln in lens:
            prefix = [torch.cat([e, *p], dim=d) if p else e
                      for e, p, d in zip(stage.empty_kv(x.size(0)), kv_parts, stage.kv_dims)]
            sliced.values = {}
            out = sliced.run(x[:, off:off + ln], off, *prefix)
            for parts, k in zip(kv_parts, out[1:]):
                parts.append(k)
            for name, v in sliced.values.items():
                per_slice.setdefault(name, []).append(v)
            off += ln
    stage_nodes = {n.name for n in stage.graph.nodes}
    for n in captured.nodes:
        if n.op != "call_function" or n.name not in per_slice or n.name not in stage_nodes:
            continue
        ref = values.get(n.name)
        axes = node_token_axes(n, seq_sym)
        if not isinstance(ref, torch.Tensor) or len(axes) != 1:
            continue
        if not (ref.is_floating_point() or ref.dtype == torch.long):
            continue
        parts = per_slice[n.name]
        if len(parts) != len(lens) or not all(isinstance(p, torch.Tensor) for p in parts):
            continue
        try:
            got = torch.cat(parts, dim=axes[0])
        except RuntimeError:
            continue
        if got.shape != ref.shape:
            continue
        diff = (got.double() - ref.double()).abs().max().item()
        if diff > 1e-4 * (1.0 + ref.double().abs().max().item()):
            return n
    return None

