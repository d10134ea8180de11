"""bench/gpu_checks.py on the CPU (gloo): the launches it makes on a GPU machine, both ways (one
node of several processes, and one node per rank as on a machine with fewer GPUs than ranks),
run plain torch's communication probes (bench/nccl_probe.py), train the plan and pass the
gradient check, and its table says so; once, the score-transform bench runs at a small size.
The reference interpreter's run is one process, the same either way: the one-node run checks it,
and the failing run checks that its verdict fails too. The failing run needs neither the probes
nor the library's loop (both checked above): it leaves them out."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


# one slice of 16 behind a cached prefix of 16 (the bench's compiles dominate its time)
TINY_SCORES = "--lengths 16 --offsets 16 --heads 2 --head-dim 16 --repeats 1"
TINY_OVERLAP = "--steps 1 --repeats 1 --width 64 --seq-len 32 --layers 2 --slices 4"


def run_checks(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_checks.py"), "--device", "cpu", "--no-slicing",
           "--out", str(tmp_path), "--timeout", "60", "--limit", "200", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def rows(text: str) -> dict[tuple[str, str], list[str]]:
    """The rows of the plans' table (the one under the `| plan` header; later tables are the
    score-transform bench's)."""
    out, inside = {}, False
    for line in text.splitlines():
        if line.startswith("| plan"):
            inside = True
        elif inside and line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            out[(cells[0], cells[1])] = cells
        elif inside and not line.startswith("|"):
            break
    return out


def test_one_node_and_a_node_per_rank_both_pass_the_gradient_check(tmp_path):
    for mode, extra in (("node", ["--score-args", TINY_SCORES, "--overlap-args", TINY_OVERLAP]),
                        ("nodes", ["--nodes", "--no-score-transforms", "--no-ssm", "--no-overlap",
                                   "--no-interpret"])):
        p = run_checks(tmp_path / mode, "--only", "1f1b", *extra)
        # (the checks' own lines first, then the script's last line naming what failed)
        assert p.returncode == 0, p.stdout[:3000] + "\n...\n" + p.stdout[-300:] + p.stderr[-2000:]
        assert p.stdout.rstrip().endswith("all checks passed"), p.stdout[-300:]
        # plain torch ran the plans' communication patterns first (bench/nccl_probe.py)
        assert "plain torch: one-way ok; exchange ok; exchange-after-one-way ok" in p.stdout, p.stdout
        table = rows(p.stdout)
        want = {("1f1b", "fp32"), ("1f1b --interpret", "fp32")} if mode == "node" else {("1f1b", "fp32")}
        assert set(table) == want, p.stdout
        for cells in table.values():
            assert cells[3] == "ok" and "grad error" in cells[4] and "step 2/2" in cells[4], cells
        assert (tmp_path / mode / "1f1b-fp32.log").read_text().count("verify-grads:") == 1
        # a user's own loop through the library, on 2 ranks
        assert "# examples/library_loop.py (import tpc, 2 ranks): ok; step " in p.stdout, p.stdout[-2000:]
        if mode == "node":  # the written-out attention against FlexAttention, its three tables
            assert f"# bench/score_transforms.py --device cpu --dtype fp32 {TINY_SCORES}" in p.stdout, p.stdout
            for title in ("## fwd+bwd", "## fwd (", "## exactness"):
                assert title in p.stdout, p.stdout[-3000:]
            # a state-space model sliced against the model as written (bench/ssm_slicing.py --quick)
            assert "# bench/ssm_slicing.py --device cpu --quick" in p.stdout, p.stdout[-3000:]
            assert "| mamba2 | 8 slices of 8" in p.stdout, p.stdout[-3000:]
            # a tensor group of 2 with and without slice pairs (bench/tensor_overlap.py)
            for schedule in ("gpipe", "zb-h1"):
                assert f"# bench/tensor_overlap.py --schedule {schedule} (2 ranks): ok" in p.stdout, p.stdout[-3000:]
            assert "paired / plain: step " in p.stdout, p.stdout[-3000:]


def test_a_failing_run_fails_the_script(tmp_path):
    """A tolerance no run can meet: every check fails and the script's status says so."""
    p = run_checks(tmp_path, "--only", "1f1b", "--tolerance", "1e-12", "--no-score-transforms", "--no-ssm",
                   "--no-overlap", "--no-probe", "--no-library")
    assert p.returncode == 1
    table = rows(p.stdout)
    assert set(table) == {("1f1b", "fp32"), ("1f1b --interpret", "fp32")}, p.stdout
    assert all(cells[3] == "exit 1" for cells in table.values()), p.stdout
    assert p.stdout.rstrip().endswith("failed: 1f1b --interpret fp32, 1f1b fp32") or \
        p.stdout.rstrip().endswith("failed: 1f1b fp32, 1f1b --interpret fp32"), p.stdout[-300:]
