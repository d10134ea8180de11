"""Where a plan's ranks run: which global ranks form each pipeline, and which of its links cross nodes.

The global rank of pipeline rank p in data-parallel replica d is d * pipe + p (docs/ir.md), so
each pipeline is `pipe` consecutive global ranks. torchrun numbers the processes node by node
(node n runs global ranks n * nproc .. (n+1) * nproc - 1), so when `pipe` divides the
processes per node every pipeline lies inside one node: its activations and gradients go over
the node's fast links, and only the data-parallel all-reduce crosses nodes. When it does not,
some stage boundaries cross nodes; `describe` says which.
"""

from __future__ import annotations


def pipelines(pipe: int, data: int) -> list[list[int]]:
    """The global ranks of each replica's pipeline, in stage order."""
    return [[d * pipe + p for p in range(pipe)] for d in range(data)]


def crossing_boundaries(pipe: int, data: int, node_of: list[int]) -> list[tuple[int, int]]:
    """(replica, p) for each link between pipeline ranks p and p+1 whose two processes are on
    different nodes."""
    return [(d, p) for d, ranks in enumerate(pipelines(pipe, data)) for p in range(pipe - 1)
            if node_of[ranks[p]] != node_of[ranks[p + 1]]]


def describe(pipe: int, data: int, node_of: list[int]) -> list[str]:
    """Lines for people: the layout over the nodes, and a note when pipeline neighbours cross
    nodes although a node has room for a whole pipeline."""
    nodes = sorted(set(node_of))
    per_node = {n: node_of.count(n) for n in nodes}
    head = (f"ranks: mesh pipe {pipe} x data {data} on {len(nodes)} node{'s' * (len(nodes) != 1)} "
            f"({', '.join(str(per_node[n]) for n in nodes)} processes)")
    lines = [head]
    for d, ranks in enumerate(pipelines(pipe, data)):
        on = sorted({node_of[r] for r in ranks})
        lines.append(f"  pipeline {d}: global ranks {ranks[0]}..{ranks[-1]} on node{'s' * (len(on) > 1)} "
                     f"{', '.join(map(str, on))}")
    crossing = crossing_boundaries(pipe, data, node_of)
    if crossing:
        links = ", ".join(f"{d * pipe + p}->{d * pipe + p + 1}" for d, p in crossing)
        lines.append(f"  pipeline links between nodes: {links}")
        if pipe <= min(per_node.values()):
            lines.append(f"  note: a node runs {min(per_node.values())} processes, room for a whole pipeline of "
                         f"{pipe}; with a multiple of {pipe} processes per node (--nproc-per-node) every "
                         "pipeline stays inside one node")
    if data > 1 and len(nodes) > 1:
        lines.append("  data-parallel all-reduce: between nodes" if any(
            len({node_of[d * pipe + p] for d in range(data)}) > 1 for p in range(pipe)) else
            "  data-parallel all-reduce: inside each node")
    return lines
