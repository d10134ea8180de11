"""Helpers shared by the benchmarks: fresh rank processes, peak memory, plans, medians, tables.

Every benchmark measures two things side by side in one run and reports their ratio, so that the
noise of a shared machine (other jobs, frequency changes) falls on both sides alike.

- `launch(world, target, *args)` starts `world` fresh processes (spawn) that join one gloo
  group on 127.0.0.1, each with one thread, and call `target(rank, world, *args)`; whatever the
  target returns comes back, per rank, through a file. A failed or hung rank raises.
- `reset_peak()` / `peak_above_baseline()`: the peak resident set size of this process above the
  RSS at the reset (Linux: /proc/self/clear_refs resets VmHWM), after freed heap memory has
  been handed back to the OS (malloc_trim), so memory a setup step freed is not counted as free
  room for the measured part.
- `cpu_profile(...)`: `tpc profile` in this process, unless a profile is given;
- `compile_plan(...)`: `tpc compile` in this process (the command line's own `main`).
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACHINE = "dev-cpu (2 cores, no GPU)"


def at_root() -> None:
    """Plans name their model file relative to the repository root: run from there."""
    os.chdir(ROOT)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out: str, target, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = target(rank, world, *args)
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, target, *args, limit: float = 600.0) -> list:
    """Run `target(rank, world, *args)` in `world` fresh processes; their results, by rank."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as out:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, out, target, args)) for r in range(world)]
        start = time.monotonic()
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.1, limit - (time.monotonic() - start)))
        bad = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                bad.append(f"rank {r} still running after {limit:.0f} s")
            elif p.exitcode != 0:
                bad.append(f"rank {r} exited with {p.exitcode}")
        if bad:
            raise RuntimeError("; ".join(bad))
        results = []
        for r in range(world):
            with open(Path(out) / f"rank{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


# --------------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> int:
    """Collect garbage, return freed heap to the OS, reset the peak RSS; the RSS now (KiB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return _status_kib("VmRSS")


def peak_kib() -> int:
    return _status_kib("VmHWM")


# ---------------------------------------------------------------------------------- plans


def cpu_profile(model: str, factory: str, seq_len: int, out: str | Path, *, batch: int = 1,
                given: str | None = None) -> str:
    """The path of a CPU profile: `given` as is, else `tpc profile` run now in this process
    (micro-batches of `batch` sequences), written to `out`; its time goes to stderr."""
    if given:
        return given
    from tpc.cli.main import main

    t0 = time.monotonic()
    if main(["profile", model, "--factory", factory, "--seq-len", str(seq_len), "--batch-sizes", str(batch),
             "-o", str(out)]) != 0:
        raise RuntimeError("tpc profile failed")
    print(f"  profile at L={seq_len}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return str(out)


def compile_plan(model: str, out: str | Path, *, factory: str = "model", **options) -> str:
    """`tpc compile MODEL -o OUT --key value ...` (underscores become dashes); the plan's path."""
    from tpc.cli.main import main

    argv = ["compile", model, "-o", str(out), "--factory", factory, "-q"]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    status = main(argv)
    if status != 0:
        raise RuntimeError(f"tpc {' '.join(argv)} failed with status {status}")
    return str(out)


# ---------------------------------------------------------------------------------- stats


def median(xs) -> float:
    return statistics.median(list(xs))


def table(header: list[str], rows: list[list]) -> str:
    """A Markdown table (pasted as is into docs/benchmarks.md)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in cells[1:]])


def ok(flag: bool) -> str:
    return "yes" if flag else "NO"


# ------------------------------------------------------------------------- tpc in a rank


def simulated_time(plan_path: str, profile: str | None = None) -> float:
    """`tpc simulate PLAN --cost PROFILE`'s iteration time (seconds), or with unit costs
    scaled by slice length (units) when there is no profile."""
    from tpc.compiler.costmodel.resolve import plan_cost_model
    from tpc.compiler.predict.simulate import simulate
    from tpc.ir.verify import verify_file

    plan = verify_file(plan_path)
    return simulate(plan, plan_cost_model(plan.header, cost=profile)).iteration_time


def tpc_setup(plan_path: str, seed: int = 0, comm: str = "gloo"):
    """What `tpc run` does before running, in one rank: (plan, model, sliced model); the plan
    verified under backend `comm`'s rules."""
    from tpc.executors.plan_model import load_plan_model, slice_model
    from tpc.ir.verify import verify_file

    plan = verify_file(plan_path, comm)
    model = load_plan_model(plan, seed)
    return plan, model, slice_model(model, plan)


def tpc_run(plan, model, sliced, rank: int, world: int, steps: int, *, optim=("sgd", 1e-4, 0.0),
            record=False, trace=False, on_step=None, before=None, comm=None, compile=False):
    """`tpc run`'s distributed executor (`run_plan`) on this rank's process group, random tokens
    of seed 0, `optim` = (kind, lr, weight decay) (default: plain SGD); returns its RankOutcome.
    `compile`: `tpc run --compile` (the programs of a process are compiled once, at its first run)."""
    import torch

    from tpc.executors.training.batches import RandomTokens
    from tpc.executors.distributed import World, run_plan
    from tpc.executors.options import RunOptions
    from tpc.executors.training.optimizer import OptimSpec

    h = plan.header.shape
    options = RunOptions(steps=steps, optim=OptimSpec(*optim), lr_schedule="constant", record_grads=record,
                         trace=trace, timeout=600.0, comm=comm, compile=compile, quiet=True)
    return run_plan(plan, World(rank, world, rank), options, model=model, device=torch.device("cpu"),
                    sliced=sliced, batches=RandomTokens(0, h.batch, h.seq, h.vocab), on_step=on_step,
                    before_instr=before)


def tpc_step_times(plan, model, sliced, rank: int, world: int, steps: int, compile: bool = False) -> list[float]:
    """Wall time of each step of a `run_plan` of `steps` steps (each ends with the all-reduce of
    the loss, a sync point of every rank)."""
    times = []
    tpc_run(plan, model, sliced, rank, world, steps, on_step=lambda s, loss, info: times.append(info["step_time"]),
            compile=compile)
    return times


def load_note() -> str:
    """The machine's 1-minute load average now: what else was competing for the 2 cores."""
    return f"load average {os.getloadavg()[0]:.1f}"


def rank_alternate(rank: int, world: int, pairs: list, repeats: int, block: int, compile: bool = False):
    """For each (unsliced, sliced) plan pair: `repeats` x (a block of unsliced steps, a block of
    sliced steps); the step times of each, first step of every block left out. `compile`: both
    run `--compile`."""
    out = []
    for plans in pairs:
        setups = [tpc_setup(p) for p in plans]
        times = [[], []]
        for _ in range(repeats):
            for which, (plan, model, sliced) in enumerate(setups):
                times[which] += tpc_step_times(plan, model, sliced, rank, world, block + 1, compile)[1:]
        out.append(times)
    return out
