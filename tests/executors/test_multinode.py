"""`tpc run` beyond one machine: two torchrun agents on this machine act as two nodes (each
`--nnodes 2 --nproc-per-node 2`, c10d rendezvous on localhost), and the run's loss and gradients
are those of plain autograd, for pp=2 x dp=2 (each pipeline inside a node, the data-parallel
all-reduce between nodes) and pp=4 (one pipeline over both nodes). Slow (two rendezvous, four
processes on a small machine): two cases, generous limits, no timing asserted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.executors.dist_harness import free_port
from tests.executors.real import real_plan
from tpc.ir.printer import print_plan

LIMIT = 400  # seconds for the whole two-node run before it counts as a hang

CASES = {
    "pp2xdp2": (dict(schedule="1f1b", stages=2, dp=2, batch=4, microbatches=2, slices="2"),
                ["pipeline 0: global ranks 0..1 on node ", "pipeline 1: global ranks 2..3 on node ",
                 "data-parallel all-reduce: between nodes"]),
    "pp4": (dict(schedule="seq1f1b", stages=4, batch=4, microbatches=2, slices="2"),
            ["pipeline 0: global ranks 0..3 on nodes 0, 1", "pipeline links between nodes: 1->2"]),
}


def two_nodes(plan: str, port: int) -> list[subprocess.CompletedProcess]:
    """Both agents' results. Each runs `python -m tpc.cli.main run` (this interpreter's tpc)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"tpc-{port}",
           "--max-restarts", "0", "-m", "tpc.cli.main", "run", plan, "--verify-grads", "--steps", "2",
           "--timeout", "120"]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
              for _ in range(2)]
    done = []
    try:
        for a in agents:
            out, err = a.communicate(timeout=LIMIT)
            done.append(subprocess.CompletedProcess(cmd, a.returncode, out, err))
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.communicate()
    return done


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_nodes_train_exactly(tmp_path, name):
    kw, layout = CASES[name]
    plan = tmp_path / "plan.tpir"
    plan.write_text(print_plan(real_plan("gpt", **kw)), encoding="utf-8")
    agents = two_nodes(str(plan), free_port())
    assert [a.returncode for a in agents] == [0, 0], [a.stderr[-3000:] for a in agents]
    out = "".join(a.stdout for a in agents)
    assert out.count("verify-grads:") == 1 and ": ok" in out, out  # rank 0 says it, on whichever node
    assert "step 2/2  loss" in out
    for line in ["ranks: mesh pipe", "on 2 nodes (2, 2 processes)", *layout]:
        assert line in out, out
