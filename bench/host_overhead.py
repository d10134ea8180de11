"""The host's cost per token slice: eager autograd against the compiled stage programs.

Every slice a stage runs costs the host a fixed amount whatever its tokens: on a GPU, one kernel
launch per operation dispatched from Python. `--compile` runs a stage's programs compiled by
inductor (docs/compile.md); this script measures what that leaves, side by side in one process,
for the two halves of two models: a 4-layer width-64 GPT (examples/gpt.py) and the `long` model
(bench/models/gpt_untied.py, 4 layers x width 256), L = 64 tokens as 8-token slices, forward in
token order then backward in reverse, through the `StageRuntime` both executors use:

- operations dispatched per slice (a TorchDispatchMode counts them: exact, the same every run);
- fixed host time per slice: (time of L as 8 slices - time of L as 1 slice) / 7, the two modes
  alternating in the same process, median of `--repeats`;
- the time to compile the programs of the shapes used (inductor's on-disk cache makes a second
  run of the script faster: it says so).

Targets (issue: compiled stage programs): ops per slice <= 0.3x eager, fixed host time per
slice <= 0.4x eager.

    OMP_NUM_THREADS=1 python bench/host_overhead.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, at_root, table  # noqa: E402

L, SLICES = 64, 8
MODELS = (("gpt 4x64", "examples/gpt.py", "model", dict(n_layer=4, n_embd=64, n_head=4, block_size=L)),
          ("long 4x256", "bench/models/gpt_untied.py", "long", {}))


def _stages(path: str, factory: str, overrides: dict):
    import torch

    from tpc.compiler.frontend import SlicedModel, load_model, read_vocab
    from tpc.compiler.frontend.model_file import import_model_file

    torch.manual_seed(0)
    model = import_model_file(path).model(**overrides) if overrides else load_model(path, factory)
    vocab = read_vocab(model, path)
    sliced = SlicedModel.from_model(model, seq_len=L, vocab=vocab, check_slices=None)
    n = sliced.num_units
    return model, sliced, vocab, [(0, n // 2), (n // 2, n)]


class _Side:
    """One stage half run one way (eager autograd, or compiled programs)."""

    def __init__(self, sliced, model, vocab, lo, hi, compiled: bool):
        import torch

        from tpc.compiler.programs.stage_programs import ProgramOptions, StagePrograms
        from tpc.executors.stage_runtime import StageRuntime

        self.stage = sliced.stage_module(lo, hi, params_from=model)
        programs = StagePrograms(self.stage, ProgramOptions(compile=True)) if compiled else None
        self.rt = StageRuntime(self.stage, 1.0 / L, programs)
        self.hidden, self.n = sliced.hidden_size, sliced.num_units
        ids = torch.randint(0, vocab, (1, L + 1))
        self.x = ids[:, :L].contiguous() if lo == 0 else torch.randn(1, L, self.hidden)
        self.targets = ids[:, 1:].contiguous() if hi == self.n else None
        self.grads = {n: torch.ones(1, L // n, self.hidden) for n in (1, SLICES)}

    def step(self, slices: int) -> None:
        step = L // slices
        for i in range(slices):
            cut = slice(i * step, (i + 1) * step)
            self.rt.forward(0, i, self.x[:, cut], i * step, capacity=L,
                            targets=None if self.targets is None else self.targets[:, cut])
        for i in reversed(range(slices)):
            self.rt.backward(0, i, None if self.stage.is_last else self.grads[slices])
        self.rt.free_kv(0)


def _count(side: _Side) -> float:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        side.step(SLICES)
    return Count.n / SLICES


def measure(repeats: int) -> list[list[str]]:
    import torch

    torch.set_num_threads(1)
    rows = []
    for label, path, factory, overrides in MODELS:
        model, sliced, vocab, halves = _stages(path, factory, overrides)
        for lo, hi in halves:
            eager = _Side(sliced, model, vocab, lo, hi, compiled=False)
            comp = _Side(sliced, model, vocab, lo, hi, compiled=True)
            t0 = time.perf_counter()
            for n in (1, SLICES):
                comp.step(n)  # compiles the programs of both slicings
            compile_s = time.perf_counter() - t0
            eager.step(1)
            eager.step(SLICES)
            ops = [_count(eager), _count(comp)]
            times: dict = {(s, n): [] for s in ("eager", "compiled") for n in (1, SLICES)}
            for _ in range(repeats):
                for name, side in (("eager", eager), ("compiled", comp)):
                    for n in (1, SLICES):
                        t = time.perf_counter()
                        side.step(n)
                        times[(name, n)].append(time.perf_counter() - t)
            fixed = {s: (statistics.median(times[(s, SLICES)]) - statistics.median(times[(s, 1)])) / (SLICES - 1)
                     for s in ("eager", "compiled")}
            rows.append([f"{label} units {lo}:{hi}", f"{ops[0]:.1f}", f"{ops[1]:.1f}", f"{ops[1] / ops[0]:.3f}",
                         f"{fixed['eager'] * 1e3:.3f}", f"{fixed['compiled'] * 1e3:.3f}",
                         f"{fixed['compiled'] / fixed['eager']:.3f}", f"{compile_s:.1f}"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per measurement (median; default 7)")
    args = ap.parse_args(argv)
    at_root()
    print(f"host cost per slice on {MACHINE}: L={L} as {SLICES} slices vs 1, eager autograd vs --compile")
    print(table(["stage", "ops/slice eager", "ops/slice compiled", "ops ratio", "fixed ms eager",
                 "fixed ms compiled", "time ratio", "compile s"], measure(args.repeats)))
    from tpc.compiler.programs.compiled import cache_dir

    print(f"(compile s: cold, or from inductor's cache in {cache_dir()} when an earlier run compiled them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
