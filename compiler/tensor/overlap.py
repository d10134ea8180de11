"""Two token slices of a tensor-parallel stage in one program, so that the collectives of one
run while the other computes: Merak's sub-pipelined tensor parallelism, with the slices of a
micro-batch as its sub-pipelines (no micro-batch is split; issue #34).

`paired_program(graph, num_kv)` turns a rank's stage graph (`shard.py`, `sequence.py`: forward
`(x, offset, prefix_0 .. prefix_{n-1}[, targets]) -> (y, cached_0 .. cached_{n-1})`) into the
graph of slices a and b = a + 1 run together:

    (a's inputs, b's inputs but its prefixes, cache) -> (a's outputs, b's outputs)

- `cache` is the runtime's (`executors/stage_runtime.py`): as soon as a has computed its cached
  tensor t, the program hands it over (`cache.write(t, value)`: appended to the micro-batch's
  cache) and takes b's prefix t from it (`cache.prefix(t)`: the cached tokens before b, a's
  included), so b reads what it would read had a run first.
- A collective whose forward communicates (g; the all-gather and reduce-scatter of sequence
  parallelism) is started (`collectives.STARTED`) and waited on
  (`collectives.wait`) just before the first node that reads its output. Between the two, the
  program runs the other slice.

The order is fixed here, from the graph alone: each slice runs until it starts a collective,
then the other slice runs, unless it is b and its next node reads a prefix a has not written
yet (then a goes on). a never waits for b. Every tensor rank builds the same order from the
same graph, so all start the same collectives in the same order, which a group needs. Each
node computes what it computes in the slices' own programs, so the results are the same, bit
for bit: only the order of the two slices' nodes changes. Backward runs slice by slice, as it
does without the pair, its collectives blocking.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from tpc.compiler.tensor import collectives


def paired_program(graph: fx.Graph, num_kv: int) -> fx.Graph:
    """The graph of two consecutive slices of `graph`, interleaved (module docstring)."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out = next(n for n in nodes if n.op == "output")
    cached = list(out.args[0][1:1 + num_kv])
    prefix = placeholders[2:2 + num_kv]
    prefix_of = {p: t for t, p in enumerate(prefix)}
    body = [n for n in nodes if n.op not in ("placeholder", "output")]

    g = fx.Graph()
    envs: list[dict] = [{}, {}]
    for k, tag in enumerate("ab"):
        for p in placeholders:
            if k == 0 or p not in prefix_of:
                envs[k][p] = g.placeholder(f"{tag}_{p.name}")
    cache = g.placeholder("cache")
    written = [False] * num_kv
    pending: list[dict] = [{}, {}]  # per slice: node of the stage graph -> its Pending's node
    pos = [0, 0]

    def wait_for(k: int, n: fx.Node) -> None:
        if n in pending[k]:
            g.call_function(collectives.wait, (pending[k].pop(n),))

    def write(n: fx.Node) -> None:
        """After slice a computed n: write it where it is one of a's cached tensors."""
        for t, c in enumerate(cached):
            if c is n and not written[t]:
                wait_for(0, n)
                g.call_method("write", (cache, t, envs[0][n]))
                envs[1][prefix[t]] = g.call_method("prefix", (cache, t))
                written[t] = True

    def blocked(k: int) -> bool:
        """Slice b's next node reads a prefix slice a has not written yet."""
        if k != 1 or pos[1] >= len(body):
            return False
        return any(a in prefix_of and not written[prefix_of[a]] for a in body[pos[1]].all_input_nodes)

    def run(k: int) -> str:
        """Run slice k until it starts a collective ('started'), cannot go on ('blocked') or
        is through ('done')."""
        env = envs[k]
        while pos[k] < len(body):
            if blocked(k):
                return "blocked"
            n = body[pos[k]]
            for a in n.all_input_nodes:
                wait_for(k, a)
            pos[k] += 1
            if n.op == "call_function" and n.target in collectives.STARTED and not n.kwargs:
                both = g.call_function(collectives.STARTED[n.target], fx.map_arg(n.args, lambda a: env[a]))
                env[n] = g.call_function(operator.getitem, (both, 0))
                pending[k][n] = g.call_function(operator.getitem, (both, 1))
                if k == 0:
                    write(n)
                return "started"
            env[n] = g.node_copy(n, lambda a: env[a])
            if k == 0:
                write(n)
        return "done"

    for p in placeholders:  # a cached tensor may be an input itself
        write(p)
    k, done = 0, [False, False]
    while not all(done):
        state = run(k)
        done[k] = state == "done"
        other = 1 - k
        if not done[other] and (state != "started" or not blocked(other)):
            k = other
    if not all(written):
        raise RuntimeError("internal: slice a's program did not compute all its cached tensors")
    outs = []
    for k in (0, 1):
        for a in out.all_input_nodes:
            wait_for(k, a)
        outs += list(fx.map_arg(out.args[0], lambda a: envs[k][a]))
    for k in (0, 1):
        for n in list(pending[k]):
            wait_for(k, n)
    g.output(tuple(outs))
    g.lint()
    return g
