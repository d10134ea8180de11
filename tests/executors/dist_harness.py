"""Starting ranks of the distributed executor as local processes (gloo on 127.0.0.1), for tests.

`launch(world, target, *args)` spawns `world` processes that each set the torchrun environment
and call `target(rank, out_dir, *args)`; each process's stderr goes to `out_dir/rank<r>.err`.
It returns the exit codes, the stderr texts and the elapsed time; a process still alive after
`limit` seconds is killed and counts as a hang (exit code None).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, target, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    err = open(Path(out_dir) / f"rank{rank}.err", "w")
    os.dup2(err.fileno(), 2)
    sys.stderr = err
    import torch

    torch.set_num_threads(1)
    target(rank, out_dir, *args)
    err.flush()


def launch(world: int, out_dir: Path, target, *args, limit: float = 120.0):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, str(out_dir), target, args)) for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.1, limit - (time.monotonic() - start)))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    errs = [(Path(out_dir) / f"rank{r}.err").read_text() if (Path(out_dir) / f"rank{r}.err").exists() else ""
            for r in range(world)]
    return codes, errs


def run_cases(out_dir: Path, world: int, target, cases, timeout: float, limit: float) -> list:
    """Run `target(rank, world, out_dir, cases, timeout)` on `world` ranks; each writes
    case{i}_rank{r}.pt. Returns, per case, every rank's saved result."""
    import torch

    codes, errs = launch(world, out_dir, target, cases, timeout, limit=limit)
    assert codes == [0] * world, errs
    return [[torch.load(out_dir / f"case{i}_rank{r}.pt") for r in range(world)] for i in range(len(cases))]


def tpc_command() -> str:
    """The `tpc` console script of the Python running the tests (a virtual environment's own,
    not whichever `tpc` comes first on PATH)."""
    beside = Path(sys.executable).parent / "tpc"
    return str(beside) if beside.exists() else "tpc"


def torchrun_verified(plan, tmp_path: Path, steps: int = 3, clip: float = 0.5) -> list[dict]:
    """`tpc run PLAN` under torchrun, one process per rank of the plan's mesh, `steps` steps
    clipped at `clip`, with --verify-grads (which must say ok), the metrics and a checkpoint
    written to tmp_path/ck; returns the metrics rows."""
    import json
    import subprocess

    from tpc.ir.printer import print_plan

    path = tmp_path / "plan.tpir"
    path.write_text(print_plan(plan), encoding="utf-8")
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(plan.header.mesh.value.size),
           "--master-port", str(free_port()), "--no-python", tpc_command(), "run", str(path), "--steps", str(steps),
           "--verify-grads", "--grad-clip", str(clip), "--metrics", str(metrics), "--timeout", "60", "--device", "cpu",
           "--checkpoint-dir", str(tmp_path / "ck")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verify-grads: loss" in done.stdout and ": ok" in done.stdout, done.stdout[-2000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def torchrun_many(plans: dict, tmp_path: Path, args: list[str], nodes: int = 1) -> dict[str, str]:
    """`tpc run PLAN *args` of several plans of one world size in one torchrun launch
    (tests/executors/run_plans.py: each rank runs `tpc run` of each plan in turn): the launch and
    the imports once, not once a plan. `{case}` in `args` is the case's own folder,
    tmp_path/cases/NAME. With `nodes` > 1, that many torchrun agents on this machine act as
    nodes (c10d rendezvous on localhost), each with its share of the processes. Asserts that
    every rank of every case ended with status 0, naming the case that did not (the first that
    failed: the later ones do not run); returns each case's standard output, every rank's."""
    import subprocess

    from tpc.ir.printer import print_plan

    sizes = {name: plan.header.mesh.value.size for name, plan in plans.items()}
    assert len(set(sizes.values())) == 1, f"one launch runs plans of one world size: {sizes}"
    world = next(iter(sizes.values()))
    cases = []
    for name, plan in plans.items():
        path = tmp_path / f"{name}.tpir"
        path.write_text(print_plan(plan), encoding="utf-8")
        cases.append(f"{name}={path}")
    out = tmp_path / "cases"
    port = free_port()
    where = (["--nproc-per-node", str(world), "--master-port", str(port)] if nodes == 1 else
             ["--nnodes", str(nodes), "--nproc-per-node", str(world // nodes), "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"tpc-{port}", "--max-restarts", "0"])
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, str(Path(__file__).with_name("run_plans.py")),
           str(out), *cases, "--", *args]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1")) for _ in range(nodes)]
    codes, errors = [], []
    try:
        for a in agents:
            _, err = a.communicate(timeout=300 * len(plans))
            codes.append(a.returncode)
            errors.append(err)
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.communicate()
    done = subprocess.CompletedProcess(cmd, max(codes), "", "\n".join(errors))
    shown = {}
    for name in plans:
        folder = out / name

        def text(rank: int, kind: str) -> str:
            f = folder / f"rank{rank}.{kind}"
            return f.read_text() if f.exists() else ""

        status = [text(r, "status") for r in range(world)]
        assert status == ["0"] * world, (
            f"case {name}: exit status per rank {status} ('' = did not finish)\n"
            + "\n".join(f"--- rank {r}\n{text(r, 'out')[-1500:]}{text(r, 'err')[-3000:]}" for r in range(world))
            + f"\n--- torchrun\n{done.stderr[-2000:]}")
        shown[name] = "".join(text(r, "out") for r in range(world))
    assert done.returncode == 0, done.stderr[-3000:]
    return shown


def torchrun_verified_many(plans: dict, tmp_path: Path, steps: int = 3, clip: float = 0.5) -> dict[str, list[dict]]:
    """`torchrun_verified` of several plans of one world size in one torchrun launch
    (`torchrun_many`, the same arguments as `torchrun_verified`'s; the metrics and the checkpoint
    in tmp_path/cases/NAME/m.jsonl and ck). Returns each case's metrics rows."""
    import json

    shown = torchrun_many(plans, tmp_path, [
        "--steps", str(steps), "--verify-grads", "--grad-clip", str(clip), "--metrics", "{case}/m.jsonl",
        "--timeout", "60", "--device", "cpu", "--checkpoint-dir", "{case}/ck"])
    rows = {}
    for name, text in shown.items():
        assert "verify-grads: loss" in text and ": ok" in text, f"case {name}: {text[-2000:]}"
        rows[name] = [json.loads(line) for line in (tmp_path / "cases" / name / "m.jsonl").read_text().splitlines()]
    return rows
