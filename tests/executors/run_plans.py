"""Rank side of `dist_harness.torchrun_verified_many`: under one torchrun launch, this rank runs
`tpc run PLAN ...` (the console script's own `main`) for several plans of the same world size,
one after the other, so that the launch and the imports are paid once, not once a plan.

    python -m torch.distributed.run --nproc-per-node N tests/executors/run_plans.py OUT NAME=PLAN... -- ARGS...

Each case's output goes to OUT/NAME/rank<r>.out and .err (file descriptors 1 and 2, so that a
failure that leaves at once, `os._exit(1)`, still leaves its words there); its exit status to
OUT/NAME/rank<r>.status once it returned. A failing case ends the process (the peers may still
wait on it): the later cases are not run, and the test says which case failed. ARGS may name
`{case}`, OUT/NAME's folder (the metrics file, the checkpoint folder).

The first case joins torchrun's own store; each later one a store of its own (rank 0 hosts it on
a free port and says which through torchrun's store): a second default process group on the
first one's store would read the keys the first one left there.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path


def fresh_store(case: int) -> None:
    import torch.distributed as dist

    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["TPC_FIRST_MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=120))
    key = f"tpc-run-plans-port-{case}"
    if os.environ["RANK"] == "0":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        agent.set(key, str(port))
    else:
        port = int(agent.get(key))
    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")


def main(argv: list[str]) -> int:
    from tpc.cli.main import main as tpc

    out, rest = Path(argv[0]), argv[1:]
    split = rest.index("--")
    cases, args = [c.split("=", 1) for c in rest[:split]], rest[split + 1:]
    rank = os.environ["RANK"]
    os.environ["TPC_FIRST_MASTER_PORT"] = os.environ["MASTER_PORT"]
    saved = os.dup(1), os.dup(2)
    for i, (name, plan) in enumerate(cases):
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        if i:
            fresh_store(i)
        sys.stdout.flush()
        sys.stderr.flush()
        with open(folder / f"rank{rank}.out", "w") as o, open(folder / f"rank{rank}.err", "w") as e:
            os.dup2(o.fileno(), 1)
            os.dup2(e.fileno(), 2)
            try:
                status = tpc(["run", plan, *(a.replace("{case}", str(folder)) for a in args)])
            except SystemExit as stop:
                status = stop.code if isinstance(stop.code, int) else 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
        (folder / f"rank{rank}.status").write_text(str(status))
        if status != 0:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
