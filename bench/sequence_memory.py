"""Activation bytes a stage keeps for its backward, with tensor and sequence parallelism, measured.

For each example, one middle stage (its decoder layers, no embedding or head) runs the forward
of one slice of L tokens on each of its T = 2 tensor ranks (threads of this process, the
interpreter's way), and every tensor autograd saves for the backward is counted
(`torch.autograd.graph.saved_tensors_hooks`; a tensor saved twice counted once), beside the
message the stage sends. Three ways: the stage whole (no tensor axis), split over 2 tensor
ranks, and split with sequence parallelism. Megatron's analysis: tensor parallelism divides the
activations inside the attention and MLP regions by T and leaves the norms', residual stream's
and dropout's whole; sequence parallelism divides those by T too.

    OMP_NUM_THREADS=1 python bench/sequence_memory.py
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import at_root, table  # noqa: E402

MODELS = ["examples/nanogpt.py", "examples/llama.py"]
L, ROWS = 256, 2


def saved_bytes(module, x) -> tuple[int, tuple]:
    """(bytes autograd saves in one forward of `module` on `x`, the output's shape)."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = module(x, 0, module.empty_kv(x.size(0)))
    return sum(seen.values()), tuple(y.shape)


def measure(path: str) -> list[list]:
    from tpc.compiler.frontend import SlicedModel, load_model, read_vocab
    from tpc.compiler.tensor import shard_stage, thread_groups

    torch.manual_seed(0)
    model = load_model(path, "model")
    sm = SlicedModel.from_model(model, seq_len=L, vocab=read_vocab(model, path))
    lo, hi = 1, sm.num_units - 1  # the decoder layers
    hidden = sm.hidden_size
    x = torch.randn(ROWS, L, hidden)
    whole, shape = saved_bytes(sm.stage_module(lo, hi, with_loss=False), x.clone().requires_grad_(True))
    rows = [[Path(path).name, "whole (T = 1)", f"{whole / 2**20:.2f}", "1.000", str(shape)]]
    for sequence in (False, True):
        groups = thread_groups(2)
        out = [None, None]

        def run(r):
            st = shard_stage(sm, lo, hi, 2, r, groups[r], with_loss=False, sequence=sequence)
            part = x.chunk(2, dim=1)[r] if sequence else x
            out[r] = saved_bytes(st, part.clone().requires_grad_(True))

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got, shape = out[0]
        rows.append([Path(path).name, "T = 2, sequence parallel" if sequence else "T = 2",
                     f"{got / 2**20:.2f}", f"{got / whole:.3f}", str(shape)])
    return rows


def main() -> int:
    at_root()
    rows = [r for path in MODELS for r in measure(path)]
    print(f"a middle stage's forward of one slice of {L} tokens x {ROWS} rows, per tensor rank:")
    print(table(["model", "split", "saved for backward MiB", "/ whole", "output (message) shape"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
