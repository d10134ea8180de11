"""Parameter and optimizer-state bytes per rank with a tensor axis, measured (issue 34).

Compiles each example at pipe 2 with tensor degree 1, 2 and 4 (`tpc compile --tensor T`), runs
one AdamW step of each plan in the reference interpreter (every rank its own engine and
optimizer, as separate processes would have), and sums the bytes of the tensors each rank
holds: its stages' parameters (its parts of the split weights, the replicated ones whole) and
their AdamW state. Beside them, the ratio to the same pipeline rank of the plan without the
axis, and what a perfect 1/T would be. Target: 1/T.

    OMP_NUM_THREADS=1 python bench/tensor_bytes.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import at_root, compile_plan, table  # noqa: E402

MODELS = {  # file: why it is here
    "examples/nanogpt.py": "nanoGPT: fused QKV, tied head (split by the vocabulary)",
    "examples/llama.py": "torchtitan-style Llama: GQA 4/2 (at T = 4 the 2 key/value heads are replicated)",
}
DEGREES = (1, 2, 4)


def held(plan_path: str):
    """(global rank -> (parameter bytes, optimizer-state bytes) after one step, the mesh)."""
    from tpc.executors.interpreter import interpret
    from tpc.executors.options import RunOptions
    from tpc.ir.verify import verify_file

    plan = verify_file(plan_path)
    result = interpret(plan, RunOptions(steps=1, quiet=True))
    return result.held_bytes, plan.header.mesh.value


def main() -> int:
    at_root()
    rows = []
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for model, why in MODELS.items():
            base = None
            for T in DEGREES:
                path = compile_plan(model, Path(tmp) / f"{Path(model).stem}-t{T}.tpir", seq_len=64, batch=4,
                                    stages=2, tensor=T)
                got, mesh = held(path)
                if T == 1:
                    base = got
                for r in mesh.ranks():
                    params, optim = got[r]
                    whole_p, whole_o = base[mesh.pipe_rank(r)]
                    ratio_p, ratio_o = params / whole_p, optim / whole_o
                    ok &= ratio_p <= 1 / T + 0.02
                    rows.append([Path(model).name, T, r, mesh.pipe_rank(r), mesh.tensor_rank(r),
                                 f"{params / 1024:.1f}", f"{optim / 1024:.1f}", f"{ratio_p:.3f}", f"{ratio_o:.3f}",
                                 f"{1 / T:.3f}"])
            print(f"{Path(model).name}: {why}")
    print(table(["model", "T", "rank", "pipe", "tensor", "param KiB", "AdamW KiB", "param / pp-only",
                 "AdamW / pp-only", "1/T"], rows))
    print(f"target: parameters and AdamW state per rank at 1/T of the pp-only rank's (within 0.02): "
          f"{'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
