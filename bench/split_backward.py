"""The split backward's two halves against one plain backward, and against torch's own split.

Four blocks of bench/models/gpt_untied.py (width 128) on 2 x 256 tokens, one thread. Each
round runs a forward, then one of: a plain backward; tpc's split (`weight_grads.backward_input`
then `DeferredWeightGrads.apply`, what `backward-input` / `backward-weight` run); torch.
distributed.pipelining's `stage_backward_input` then `stage_backward_weight` (what its zero-bubble
schedules run). The three alternate round by round; medians over the rounds after the first 5.

    OMP_NUM_THREADS=1 python bench/split_backward.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, at_root, load_note, table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="rounds of each (default: 40)")
    args = ap.parse_args(argv)
    at_root()
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from tpc.executors.weight_grads import backward_input

    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = importlib.util.spec_from_file_location("gpt_untied", "bench/models/gpt_untied.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    blocks = torch.nn.Sequential(*module.model().transformer.h[:4])
    params = list(blocks.parameters())
    x0 = torch.randn(2, 256, 128)

    def one(kind: str) -> tuple[float, float]:
        x = x0.clone().requires_grad_(True)
        y = blocks(x)
        dy = torch.randn_like(y)
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        if kind == "plain":
            torch.autograd.backward([y], [dy])
            t1 = t2 = time.perf_counter()
        elif kind == "tpc":
            _, deferred = backward_input([y], [dy], [x], params)
            t1 = time.perf_counter()
            deferred.apply()
            t2 = time.perf_counter()
        else:
            _, groups = stage_backward_input([y], [dy], [x], iter(params))
            t1 = time.perf_counter()
            stage_backward_weight(iter(params), groups)
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    kinds = ("plain", "tpc", "torch")
    got = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            got[k].append(one(k))
    rows = []
    for k in kinds:
        inp = statistics.median(a for a, _ in got[k][5:]) * 1e3
        w = statistics.median(b for _, b in got[k][5:]) * 1e3
        rows.append([{"plain": "one plain backward", "tpc": "tpc split", "torch": "torch.pipelining split"}[k],
                     f"{inp:.2f}", f"{w:.2f}" if k != "plain" else "-", f"{inp + w:.2f}"])
    print(f"split backward on {MACHINE}: 4 GPT blocks (width 128), 2 x 256 tokens, 1 thread; "
          f"{args.rounds} alternating rounds; {load_note()}")
    print(table(["", "input half ms", "weight half ms", "total ms"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
