"""Where a plan's ranks run: which global ranks form each pipeline, and which of its links cross nodes.

The mesh (tpc.ir.mesh) puts each pipeline on `pipe` consecutive global ranks. torchrun numbers
the processes node by node (node n runs global ranks n * nproc .. (n+1) * nproc - 1), so when
`pipe` divides the processes per node every pipeline lies inside one node: its activations and
gradients go over the node's fast links, and only the data-parallel all-reduce crosses nodes.
When it does not, some stage boundaries cross nodes; `describe` says which.
"""

from __future__ import annotations

from tpc.ir.mesh import DATA, PIPE, Mesh


def pipelines(mesh: Mesh) -> list[tuple[int, ...]]:
    """The global ranks of each replica's pipeline, in stage order."""
    return mesh.groups(PIPE)


def crossing_boundaries(mesh: Mesh, node_of: list[int]) -> list[tuple[int, int]]:
    """(replica, p) for each link between pipeline ranks p and p+1 whose two processes are on
    different nodes."""
    return [(d, p) for d, ranks in enumerate(pipelines(mesh)) for p in range(mesh.pipe - 1)
            if node_of[ranks[p]] != node_of[ranks[p + 1]]]


def describe(mesh: Mesh, node_of: list[int]) -> list[str]:
    """Lines for people: the layout over the nodes, and a note when pipeline neighbours cross
    nodes although a node has room for a whole pipeline."""
    pipe, data = mesh.pipe, mesh.data
    nodes = sorted(set(node_of))
    per_node = {n: node_of.count(n) for n in nodes}
    head = (f"ranks: mesh pipe {pipe} x data {data} on {len(nodes)} node{'s' * (len(nodes) != 1)} "
            f"({', '.join(str(per_node[n]) for n in nodes)} processes)")
    lines = [head]
    lines_of = pipelines(mesh)
    for d, ranks in enumerate(lines_of):
        on = sorted({node_of[r] for r in ranks})
        lines.append(f"  pipeline {d}: global ranks {ranks[0]}..{ranks[-1]} on node{'s' * (len(on) > 1)} "
                     f"{', '.join(map(str, on))}")
    crossing = crossing_boundaries(mesh, node_of)
    if crossing:
        links = ", ".join(f"{lines_of[d][p]}->{lines_of[d][p + 1]}" for d, p in crossing)
        lines.append(f"  pipeline links between nodes: {links}")
        if pipe <= min(per_node.values()):
            lines.append(f"  note: a node runs {min(per_node.values())} processes, room for a whole pipeline of "
                         f"{pipe}; with a multiple of {pipe} processes per node (--nproc-per-node) every "
                         "pipeline stays inside one node")
    if data > 1 and len(nodes) > 1:
        lines.append("  data-parallel all-reduce: between nodes" if any(
            len({node_of[r] for r in group}) > 1 for group in mesh.groups(DATA)) else
            "  data-parallel all-reduce: inside each node")
    return lines
