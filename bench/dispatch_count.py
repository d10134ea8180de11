"""Operations dispatched per token slice: what a stage asks of the device, counted, not timed.

Every aten operation a stage's forward and backward of one slice dispatches is, on a GPU, a
kernel launch from Python; on a shared CPU it is the part of a step that timing cannot separate
from noise. This script counts them (a TorchDispatchMode) for the two halves of
bench/models/gpt_untied.py's `long` model (the stages of bench/token_slicing.py), L tokens as
`--slices` equal slices, forward in token order then backward in reverse, through the
`StageRuntime` both executors use. A count is exact and the same on every run: two commits
compare by it where their timings drown in noise.

    OMP_NUM_THREADS=1 python bench/dispatch_count.py [--seq-len 64] [--slices 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, at_root, table  # noqa: E402

MODEL, FACTORY = "bench/models/gpt_untied.py", "long"


def count(seq_len: int, slices: int) -> list[list[str]]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpc.compiler.frontend import SlicedModel, load_model, read_vocab
    from tpc.executors.stage_runtime import StageRuntime

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = load_model(MODEL, FACTORY)
    vocab = read_vocab(model, MODEL)
    sliced = SlicedModel.from_model(model, seq_len=seq_len, vocab=vocab, check_slices=None)
    n, step = sliced.num_units, seq_len // slices
    rows = []
    for lo, hi in ((0, n // 2), (n // 2, n)):
        runtime = StageRuntime(sliced.stage_module(lo, hi, params_from=model), 1.0 / seq_len)
        ids = torch.randint(0, vocab, (1, seq_len + 1))
        x = ids[:, :seq_len] if lo == 0 else torch.randn(1, seq_len, sliced.hidden_size)
        targets = ids[:, 1:] if hi == n else None
        forward, backward = Count(), Count()
        with forward:
            for i in range(slices):
                cut = slice(i * step, (i + 1) * step)
                runtime.forward(0, i, x[:, cut], i * step, capacity=seq_len,
                                targets=None if targets is None else targets[:, cut])
        with backward:
            for i in reversed(range(slices)):
                runtime.backward(0, i, None if hi == n else torch.ones(1, step, sliced.hidden_size))
        total = forward.n + backward.n
        rows.append([f"stage {lo}:{hi}", str(forward.n), str(backward.n), f"{total / slices:.1f}"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=64, help="tokens L (default: 64)")
    ap.add_argument("--slices", type=int, default=8, help="equal slices of L (default: 8)")
    args = ap.parse_args(argv)
    if args.seq_len % args.slices:
        ap.error(f"--slices {args.slices} does not divide --seq-len {args.seq_len}")
    at_root()
    print(f"operations dispatched on {MACHINE}: {MODEL} {FACTORY}, L={args.seq_len} as {args.slices} slices")
    print(table(["stage", "forward ops", "backward ops", "ops per slice"], count(args.seq_len, args.slices)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
