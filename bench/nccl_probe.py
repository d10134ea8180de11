"""The communication patterns of tpc's plans, in plain torch.distributed, without tpc: whether
the backend (and the machine set-up) can run them at all. Run under torchrun on 2 ranks:

    torchrun --nproc-per-node 2 bench/nccl_probe.py [--device cuda|cpu]

Each probe is one pattern a plan issues under NCCL's rules (executors/distributed.py):

1. `one-way`: rank 0 sends, rank 1 receives, each a `batch_isend_irecv` of one (a plain send);
2. `exchange`: both ranks send to each other and receive from each other in one
   `batch_isend_irecv` (an `exchange 2` of 1F1B's steady state);
3. `exchange-after-one-way`: 1 then 2, as a 1F1B plan's first messages do.

Each probe runs in a thread with a deadline. Rank 0 prints one line per probe: ok, WRONG
(the values received differ), or HANG. When `bench/gpu_checks.py` sees a tpc plan hang, this
says whether plain torch hangs the same way on the same set-up (a one-GPU machine whose ranks
act as separate NCCL hosts, say), or whether the fault is tpc's.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

PROBES = ("one-way", "exchange", "exchange-after-one-way")


def _batch(ops):
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def probe(name: str, rank: int, device: torch.device, n: int = 4096) -> bool:
    """Run one pattern; True when every value received is the one sent."""
    peer = 1 - rank
    mine = torch.full((n,), float(rank + 1), device=device)
    got = torch.zeros(n, device=device)
    if name in ("one-way", "exchange-after-one-way"):
        if rank == 0:
            _batch([dist.P2POp(dist.isend, mine, peer)])
        else:
            _batch([dist.P2POp(dist.irecv, got, peer)])
            if not bool((got == 1.0).all()):
                return False
    if name in ("exchange", "exchange-after-one-way"):
        got.zero_()
        _batch([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, got, peer)])
        if not bool((got == float(peer + 1)).all()):
            return False
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (NCCL) | cpu (gloo) (default: cuda when present)")
    ap.add_argument("--deadline", type=float, default=30.0, help="seconds a probe may take (default: 30)")
    args = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        print("nccl_probe: run it on 2 ranks (torchrun --nproc-per-node 2)", file=sys.stderr)
        return 2
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=args.deadline))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.deadline))
    dist.barrier()
    failed = False
    for name in PROBES:
        result: dict = {}
        t = threading.Thread(target=lambda: result.setdefault("ok", probe(name, rank, device)), daemon=True)
        t.start()
        t.join(args.deadline)
        verdict = "HANG" if t.is_alive() else ("ok" if result.get("ok") else "WRONG")
        if rank == 0:
            print(f"nccl_probe {name:24s} {verdict}", flush=True)
        if verdict != "ok":
            failed = True
            break  # a hung communicator cannot run the next probe
    if failed:
        os._exit(1)  # a hung collective would keep the process group from shutting down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
