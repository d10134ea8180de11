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
