"""Partition units: the graph cut where only the residual stream crosses.

The data nodes (those that depend on the token ids; static values are recomputed per stage) are
in graph order. A cut after position p is possible when exactly one data value is live across it
and that value has the residual stream's shape (B, T, C). The maximal runs between possible cuts
are merged by the numbered block they belong to (`transformer.h.0`, `layers.3`, from
`nn_module_stack`), so a unit is one Transformer block, plus one unit before the first block
(embeddings) and one after the last (final norm and head).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.fx as fx

from tpc.compiler.frontend.axes import is_residual_stream
from tpc.compiler.optimise.balance import minmax_partition


@dataclass
class Unit:
    label: str
    nodes: list[fx.Node]  # data nodes, graph order
    input: fx.Node  # value entering the unit (the ids for unit 0)
    output: fx.Node  # residual stream leaving it (logits for the last unit)
    params: list[str] = field(default_factory=list)  # attribute names this unit uses


_NUMBERED = re.compile(r"^(.*?\.\d+)(\.|$)")


def _module_path(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _block_of(n: fx.Node) -> str | None:
    m = _NUMBERED.match(_module_path(n))
    return m.group(1) if m else None


def cut_candidates(data: list[fx.Node], output: fx.Node, batch_sym, seq_sym) -> dict[int, fx.Node]:
    """Positions p (index into `data`) after which a single residual-shaped value is live, and
    that value."""
    pos = {n: i for i, n in enumerate(data)}
    last_use = {}
    for n in data:
        uses = [pos.get(u, len(data)) for u in n.users if u in pos or u is output]
        last_use[n] = max(uses, default=pos[n])
    ends: dict[int, list[fx.Node]] = {}
    for n, lu in last_use.items():
        ends.setdefault(lu, []).append(n)
    live: set[fx.Node] = set()
    out = {}
    for i, n in enumerate(data):
        if last_use[n] > i:
            live.add(n)
        for dead in ends.get(i, []):
            live.discard(dead)
        if i < len(data) - 1 and len(live) == 1:
            (only,) = live
            if is_residual_stream(only, batch_sym, seq_sym):
                out[i] = only
    return out


def make_units(data: list[fx.Node], output_value: fx.Node, output: fx.Node, batch_sym, seq_sym) -> list[Unit]:
    cuts = cut_candidates(data, output, batch_sym, seq_sym)
    bounds = [-1] + sorted(cuts) + [len(data) - 1]
    runs = [data[a + 1:b + 1] for a, b in zip(bounds, bounds[1:]) if b > a]
    # merge runs belonging to the same numbered block, and runs outside blocks that touch
    merged: list[tuple[str | None, list[fx.Node]]] = []
    for run in runs:
        blocks = [b for b in (_block_of(n) for n in run) if b]
        key = blocks[0] if blocks else None
        if merged and merged[-1][0] == key:
            merged[-1][1].extend(run)
        else:
            merged.append((key, list(run)))
    units, prev = [], data[0]
    for key, nodes in merged:
        end = data.index(nodes[-1])
        out = cuts.get(end, output_value)
        units.append(Unit(key or _outside_label(nodes), nodes, prev, out))
        prev = out
    units[-1].output = output_value
    return units


def _outside_label(nodes: list[fx.Node]) -> str:
    paths = []
    for n in nodes:
        p = _module_path(n)
        p = ".".join(p.split(".")[:2]) if p else ""
        if p and p not in paths:
            paths.append(p)
    return "+".join(paths) if paths else "model"


def partition_balanced(weights: list[int], n_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges tiling [0, len(weights)) minimising the heaviest range: the optimiser's
    min-max DP (`tpc.compiler.optimise.balance.minmax_partition`, its tie rule there), as a list."""
    return list(minmax_partition(weights, n_stages))
