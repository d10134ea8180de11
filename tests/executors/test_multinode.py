"""`tpc run` beyond one machine: two torchrun agents on this machine act as two nodes (each
`--nnodes 2 --nproc-per-node 2`, c10d rendezvous on localhost), and the run's loss and gradients
are those of plain autograd, for pp=2 x dp=2 (each pipeline inside a node, the data-parallel
all-reduce between nodes) and pp=4 (one pipeline over both nodes). Slow (two rendezvous, four
processes on a small machine): two cases, generous limits, no timing asserted."""

from __future__ import annotations

from tests.executors.dist_harness import torchrun_many
from tests.executors.real import real_plan

CASES = {
    "pp2xdp2": (dict(schedule="1f1b", stages=2, dp=2, batch=4, microbatches=2, slices="2"),
                ["pipeline 0: global ranks 0..1 on node ", "pipeline 1: global ranks 2..3 on node ",
                 "data-parallel all-reduce: between nodes"]),
    "pp4": (dict(schedule="seq1f1b", stages=4, batch=4, microbatches=2, slices="2"),
            ["pipeline 0: global ranks 0..3 on nodes 0, 1", "pipeline links between nodes: 1->2"]),
}


def test_two_nodes_train_exactly(tmp_path):
    """Both cases in one launch of the two agents (dist_harness.torchrun_many: each rank runs
    `tpc run` of each plan in turn); each case's output is checked on its own, by name."""
    plans = {name: real_plan("gpt", **kw) for name, (kw, _) in sorted(CASES.items())}
    shown = torchrun_many(plans, tmp_path, ["--verify-grads", "--steps", "2", "--timeout", "120"], nodes=2)
    for name, (_, layout) in sorted(CASES.items()):
        out = shown[name]
        assert out.count("verify-grads:") == 1 and ": ok" in out, (name, out)  # rank 0 says it, on whichever node
        assert "step 2/2  loss" in out, (name, out)
        for line in ["ranks: mesh pipe", "on 2 nodes (2, 2 processes)", *layout]:
            assert line in out, (name, line, out)
