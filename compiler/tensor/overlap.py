"""Two token slices of a tensor-parallel stage in one program, so that the collectives of one
run while the other computes: Merak's sub-pipelined tensor parallelism, with the slices of a
micro-batch as its sub-pipelines (no micro-batch is split; issue #34).

One mechanism, `interleave(first, second, handover, started)`, makes the program of two graphs
run together, where the second reads some values the first computes (the *handover*). It serves
three pairs:

- **A pair of forwards, eager** (`paired_program(graph, num_kv)`): a rank's stage graph
  (`shard.py`, `sequence.py`: `(x, offset, prefix_0 .. prefix_{n-1}[, targets]) -> (y,
  cached_0 .. cached_{n-1})`) twice, for slices a and b = a + 1. As soon as a has computed its
  cached tensor t, the program hands it over (`cache.write(t, value)`: appended to the
  micro-batch's cache) and takes b's prefix t from it (`cache.prefix(t)`: the cached tokens
  before b, a's included), so b reads what it would read had a run first.
- **A pair of forwards through the stage's traced programs** (`paired_programs`, the forward
  programs of a's and b's shapes, `compiler/programs/joint.py`): the same handover, from a's
  program's cached outputs to b's prefix inputs.
- **A pair of backwards through the traced programs** (`paired_programs`, the backward or
  backward-input programs of b's and a's shapes): slice b = i + 1 runs first, as it does one
  by one. As soon as it has computed the gradient of its prefix t (every earlier slice's keys or
  values of one layer), the program adds it into the micro-batch's gradients (`cache.write(t,
  grad)`) and takes a's upstream gradient of its cached tensor t from them (`cache.prefix(t)`),
  so a's backward of that layer reads what it would read had b's whole backward run first.

A collective whose forward communicates (g; the all-gather and reduce-scatter of sequence
parallelism), or in a program any collective operator (`torch.ops.tpc.tensor_*`: in a backward
program, f's all-reduce of an input gradient, the adjoint all-gathers and reduce-scatters), is
started (`collectives.STARTED`, `collectives.STARTED_OPS`) and waited on (`collectives.wait`)
just before the first node that reads its output. Between the two, the program runs the other
slice.

The order is fixed here, from the graphs alone: each slice runs until it starts a collective,
then the other slice runs, unless it is the second and its next node reads a handed-over value
the first has not computed yet (then the first goes on). The first never waits for the second.
Every tensor rank builds the same order from the same graphs, so all start the same collectives
in the same order, which a group needs. Each node computes what it computes in the slices' own
programs, so the results are the same, bit for bit: only the order of the two slices' nodes
changes.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

from tpc.compiler.tensor import collectives

# node -> the started form of its collective (same arguments; returns (output, Pending)), or None
Starter = Callable[[fx.Node], "Callable | None"]


def module_starter(n: fx.Node):
    """In a stage graph: the started form of g, `all_gather`, `reduce_scatter` (`STARTED`)."""
    if n.op == "call_function" and not n.kwargs:
        return collectives.STARTED.get(n.target)
    return None


def program_starter(n: fx.Node):
    """In a traced program: the started form of a collective operator (`STARTED_OPS`)."""
    if n.op == "call_function" and not n.kwargs:
        return collectives.STARTED_OPS.get(n.target)
    return None


def interleave(first: fx.Graph, second: fx.Graph, handover: list[tuple[int, int, int]], started: Starter,
               tags: tuple[str, str] = ("a", "b"), own_attrs: bool = False) -> fx.Graph:
    """The graph of `first` and `second` run together (module docstring):

        (first's inputs, second's inputs but those handed over, cache) -> (first's outputs, second's outputs)

    `handover`: (t, j, p): first's output j is handed to the cache as `cache.write(t, value)`
    once computed, and second's placeholder p is then `cache.prefix(t)`. An output j that is not
    a node of first's body (None, or one of first's inputs) is written before anything runs.
    Placeholders are named after the graphs' own with `tags` in front, and so are the
    attributes the graphs read where each reads its own root's (`own_attrs`: `_attr_name`)."""
    graphs = (first, second)
    nodes = [list(g.nodes) for g in graphs]
    placeholders = [[n for n in ns if n.op == "placeholder"] for ns in nodes]
    outs = [list(g.output_node().args[0]) for g in graphs]
    body = [[n for n in ns if n.op not in ("placeholder", "output")] for ns in nodes]
    written_by = {}  # first's node -> the handover keys it is written as
    for t, j, _ in handover:
        written_by.setdefault(outs[0][j], []).append(t)
    read_as = {placeholders[1][p]: t for t, _, p in handover}

    g = fx.Graph()
    envs: list[dict] = [{}, {}]
    for k, tag in enumerate(tags):
        for p in placeholders[k]:
            if k == 0 or p not in read_as:
                envs[k][p] = g.placeholder(f"{tag}_{p.name}")
    cache = g.placeholder("cache")
    written: set = set()
    pending: list[dict] = [{}, {}]  # per graph: its node -> its Pending's node
    pos = [0, 0]

    def wait_for(k: int, n: fx.Node) -> None:
        if n in pending[k]:
            g.call_function(collectives.wait, (pending[k].pop(n),))

    def write(n, value) -> None:
        for t in written_by.get(n, ()):
            if t not in written:
                if isinstance(n, fx.Node):
                    wait_for(0, n)
                g.call_method("write", (cache, t, value))
                written.add(t)
        for p, t in read_as.items():
            if t in written and p not in envs[1]:
                envs[1][p] = g.call_method("prefix", (cache, t))

    def blocked(k: int) -> bool:
        """Second's next node reads a handed-over value first has not written yet."""
        if k != 1 or pos[1] >= len(body[1]):
            return False
        return any(a in read_as and a not in envs[1] for a in body[1][pos[1]].all_input_nodes)

    def run(k: int) -> str:
        """Run graph k until it starts a collective ('started'), cannot go on ('blocked') or is
        through ('done')."""
        env = envs[k]
        while pos[k] < len(body[k]):
            if blocked(k):
                return "blocked"
            n = body[k][pos[k]]
            for a in n.all_input_nodes:
                wait_for(k, a)
            pos[k] += 1
            start = started(n)
            if start is not None:
                both = g.call_function(start, fx.map_arg(n.args, lambda a: env[a]))
                env[n] = g.call_function(operator.getitem, (both, 0))
                pending[k][n] = g.call_function(operator.getitem, (both, 1))
                if k == 0:
                    write(n, env[n])
                return "started"
            if own_attrs and n.op == "get_attr":
                env[n] = g.get_attr(_attr_name(tags[k], n.target))
            else:
                env[n] = g.node_copy(n, lambda a: env[a])
            if k == 0:
                write(n, env[n])
        return "done"

    body_nodes = set(body[0])
    for n in list(written_by):  # handed over from first's inputs, or nothing (None)
        if not isinstance(n, fx.Node) or n not in body_nodes:
            write(n, envs[0][n] if isinstance(n, fx.Node) else n)
    k, done = 0, [False, False]
    while not all(done):
        state = run(k)
        done[k] = state == "done"
        other = 1 - k
        if not done[other] and (state != "started" or not blocked(other)):
            k = other
    if len(written) != len({t for t, _, _ in handover}):
        raise RuntimeError("internal: the first program of a pair did not compute all it hands over")
    results = []
    for k in (0, 1):
        for a in outs[k]:
            if isinstance(a, fx.Node):
                wait_for(k, a)
        results += [envs[k][a] if isinstance(a, fx.Node) else a for a in outs[k]]
    for k in (0, 1):
        for n in list(pending[k]):
            wait_for(k, n)
    g.output(tuple(results))
    g.lint()
    return g


def paired_program(graph: fx.Graph, num_kv: int) -> fx.Graph:
    """The graph of two consecutive slices of a rank's stage graph, interleaved (module
    docstring): (a's inputs, b's inputs but its prefixes, cache) -> (a's outputs, b's outputs)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    # a's cached tensor t (output 1 + t) is b's prefix t (input 2 + t: after x and offset)
    handover = [(t, 1 + t, 2 + t) for t in range(num_kv)]
    if len(placeholders) < 2 + num_kv:
        raise RuntimeError("internal: a stage graph takes x, offset and its prefixes")
    return interleave(graph, graph, handover, module_starter)


def _attr_name(tag: str, target: str) -> str:
    return f"{tag}_{target.replace('.', '_')}"


def paired_programs(first: fx.GraphModule, second: fx.GraphModule, handover: list[tuple[int, int, int]],
                    tags: tuple[str, str] = ("a", "b")) -> fx.GraphModule:
    """Two traced programs (`compiler/programs/joint.py`) of two slices, interleaved, the
    collective operators started and waited on (module docstring): a GraphModule taking
    (first's inputs, second's inputs but those handed over, cache)."""
    graph = interleave(first.graph, second.graph, handover, program_starter, tags=tags, own_attrs=True)
    root = torch.nn.Module()
    for tag, gm in zip(tags, (first, second)):
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                value = gm
                for part in n.target.split("."):
                    value = getattr(value, part)
                setattr(root, _attr_name(tag, n.target), value)
    return fx.GraphModule(root, graph, class_name="paired")
