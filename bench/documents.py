"""Packed documents at L = 4096: what token slicing and document masks skip together.

The model is bench/models/long_nanogpt.py's `model` (examples/nanogpt.py, 2 layers, width 64, 2
heads of 32: attention is most of a step at this length), one micro-batch of one row of L
tokens, 2 pipeline stages on 2 gloo ranks (the distributed executor, `run_plan`, one process
and one thread per rank, so that the token slices overlap across the stages as they do under
torchrun). The rows are packed documents of lengths drawn uniformly from [M/2, 3M/2] (each ended
by the separator 0), a row starting at a document. Three plans, compiled by the same header
builder, schedule and lowering as `tpc compile`:

  doc-sliced    documents eos 0, 8 slices of 512 (seq1f1b): each slice attends only over its
                own documents' keys; a slice that starts a document reads no cache
  (a) across    the same 8 slices without documents: every slice attends over the whole
                prefix (what the plan would do on packed rows compiled without --documents)
  (b) unsliced  documents eos 0, one slice of L: the document kernel over the whole row
  (c) unsliced, across   one slice of L without documents: what slicing itself buys or costs
                on this machine without documents

Measured: each plan runs `--steps` steps (one batch, SGD) in the same two processes; a plan's
time is the median step after the first; the plans alternate `--repeats` times and the median
over all of a plan's steps is reported.
Counted: the attention score entries each plan's kernels compute (per layer and head; the
FLOPs are 4 x head size x entries forward), from the rows' document starts
(`runtime_ops.document_slice`), and the share of (a)'s that doc-sliced skips. A second table
times the CPU kernels the document attention could use (`runtime_ops`' choice): one SDPA call
under a dense block-diagonal mask, SDPA per document, and FlexAttention (no CPU backward in torch 2.13: refused).

    OMP_NUM_THREADS=1 python bench/documents.py [--seq-len 4096] [--means 512,2048] [--steps 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, at_root, launch, load_note, median, table  # noqa: E402

MODEL, FACTORY = "bench/models/long_nanogpt.py", "model"
EOS = 0


class PackedRows:
    """One batch of rows of packed documents, lengths uniform in [mean/2, 3 mean/2], seeded."""

    def __init__(self, rows: int, seq: int, vocab: int, mean: int, seed: int = 0):
        import numpy as np
        import torch

        rng = np.random.default_rng(seed)
        out = []
        for _ in range(rows):
            row: list[int] = []
            while len(row) < seq + 1:
                n = int(rng.integers(max(1, mean // 2), mean + mean // 2 + 1))
                row += list(rng.integers(1, vocab, n - 1)) + [EOS]
            out.append(row[:seq + 1])
        self.tokens = torch.tensor(out, dtype=torch.int64)

    def get(self, step: int):
        return self.tokens


def plans(seq: int, slices: int):
    """(label, plan, documents?) of the three plans, and the model and its SlicedModel."""
    import torch

    from tpc.cli.compile import check_options
    from tpc.compiler.frontend import SlicedModel, file_sha256, load_model, read_vocab
    from tpc.compiler.header import build_header
    from tpc.compiler.lowering.lower import lower
    from tpc.compiler.schedules import build_schedule

    torch.manual_seed(0)
    model = load_model(MODEL, FACTORY)
    vocab = read_vocab(model, MODEL)
    sliced = SlicedModel.from_model(model, seq_len=seq, vocab=vocab, check_slices=None)
    ranges = [tuple(r) for r in sliced.partition_by_params(2)]

    def plan(cuts: int, documents: bool):
        opts = check_options(stages="2", microbatches=1, seq_len=seq, batch=1, slices=str(cuts), schedule="seq1f1b",
                             **({"documents": f"eos:{EOS}"} if documents else {}))
        header = build_header(model_path=MODEL, sha256=file_sha256(MODEL), factory=FACTORY, opts=opts, vocab=vocab,
                              unit_labels=sliced.unit_labels, ranges=ranges, ties=sliced.ties(ranges))
        return lower(header, build_schedule("seq1f1b", header))

    return [("doc-sliced", plan(slices, True)), ("(a) across documents", plan(slices, False)),
            ("(b) unsliced, masked", plan(1, True)), ("(c) unsliced, across", plan(1, False))], model, sliced, vocab


def entries(plan, starts) -> int:
    """Attention score entries one layer's kernels compute for one head over the row."""
    from tpc.compiler.frontend.runtime_ops import document_slice

    total = 0
    for lo, hi in plan.header.microbatches[0].slices:
        if plan.header.documents is None:
            total += (hi - lo) * hi  # the slice's queries over the whole prefix and itself
            continue
        doc = document_slice(starts, lo, hi - lo, "cpu")
        before = doc.keys - doc.length
        total += sum((q_hi - q_lo) * (before + q_hi - k_lo) for q_lo, q_hi, k_lo in doc.segments)
    return total


def step_times(plan, model, sliced, rows, steps: int, rank: int, world: int) -> list[float]:
    """The step times after the first of `steps` steps of `plan` on this rank's process group."""
    import torch

    from tpc.executors.distributed import World, run_plan
    from tpc.executors.options import RunOptions
    from tpc.executors.training.optimizer import OptimSpec

    times: list[float] = []
    options = RunOptions(steps=steps, optim=OptimSpec(kind="sgd", lr=1e-4, weight_decay=0.0), quiet=True,
                         lr_schedule="constant", timeout=600.0,
                         documents=EOS if plan.header.documents is not None else None)
    run_plan(plan, World(rank, world, rank), options, model=copy.deepcopy(model), device=torch.device("cpu"),
             sliced=sliced, batches=rows, on_step=lambda step, loss, info: times.append(info["step_time"]))
    return times[1:]


def rank_main(rank: int, world: int, seq: int, slices: int, means: list, steps: int, repeats: int):
    """On each rank: for each mean length, every plan's step times, the plans alternating."""
    import torch

    torch.set_num_threads(1)
    variants, model, sliced, vocab = plans(seq, slices)
    out = {}
    for mean in means:
        rows = PackedRows(1, seq, vocab, mean)
        times: dict[str, list[float]] = {label: [] for label, _ in variants}
        for _ in range(repeats):
            for label, plan in variants:
                times[label] += step_times(plan, model, sliced, rows, steps, rank, world)
        out[mean] = times
    return out


def kernel_table(keys: int, mean: int) -> str:
    """CPU fwd+bwd time of one attention of `q` queries over `keys` keys (8 heads of 64) of
    documents of length `mean`: dense mask vs per document vs FlexAttention."""
    import torch
    import torch.nn.functional as F

    from tpc.compiler.frontend.runtime_ops import causal_attention, document_slice

    rows = []
    for q in sorted({min(512, keys), min(1024, keys), keys}):
        starts = (0, *range(mean // 2, keys, mean))  # documents not aligned with the queries
        doc = document_slice(starts, keys - q, q, "cpu")
        pre = doc.keys - q
        g = torch.Generator().manual_seed(0)
        qq = torch.randn(1, 8, q, 64, generator=g, requires_grad=True)
        kk = torch.randn(1, 8, doc.keys, 64, generator=g, requires_grad=True)
        vv = torch.randn(1, 8, doc.keys, 64, generator=g, requires_grad=True)
        keep = doc.keep(doc.keys)

        def dense():
            return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=keep)

        def per_document():
            return causal_attention(qq, kk[..., pre:, :], vv[..., pre:, :], kk[..., :pre, :], vv[..., :pre, :],
                                    documents=doc)

        assert torch.allclose(dense(), per_document(), atol=1e-5)
        times = {}
        for name, fn in (("dense mask", dense), ("per document", per_document)):
            fn().sum().backward()
            t0 = time.perf_counter()
            for _ in range(3):
                fn().sum().backward()
            times[name] = (time.perf_counter() - t0) / 3
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            bm = create_block_mask(lambda b, h, i, j: keep[i, j], None, None, q, doc.keys, device="cpu")
            flex_attention(qq, kk, vv, block_mask=bm).sum().backward()
            flex = "ran"
        except Exception as e:  # noqa: BLE001 - what FlexAttention says on this machine
            flex = f"{type(e).__name__} (no CPU backward)"
        rows.append([q, doc.keys, f"{times['dense mask'] * 1e3:.0f} ms", f"{times['per document'] * 1e3:.0f} ms",
                     f"{times['dense mask'] / times['per document']:.1f}x", flex])
    return table(["queries", "keys", "SDPA, dense mask", "SDPA per document", "per document faster", "FlexAttention"],
                 rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--slices", type=int, default=8)
    p.add_argument("--means", default="512,2048", help="mean document lengths, comma-separated")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    at_root()
    import torch

    torch.set_num_threads(1)
    from tpc.executors.training.documents import document_starts

    means = [int(m) for m in args.means.split(",")]
    print(f"# bench/documents.py on {MACHINE}: L={args.seq_len}, {args.slices} slices, 2 stages on 2 gloo ranks, "
          f"{load_note()}")
    measured = launch(2, rank_main, args.seq_len, args.slices, means, args.steps, args.repeats, limit=3600.0)
    variants, model, sliced, vocab = plans(args.seq_len, args.slices)
    for mean in means:
        rows = PackedRows(1, args.seq_len, vocab, mean)
        starts = document_starts(rows.tokens[:, :-1], EOS)[0]
        times = measured[0][mean]  # rank 0's clock (each step ends in the loss's all-reduce)
        base = median(times["(a) across documents"])
        counted = {label: entries(plan, starts) for label, plan in variants}
        out = []
        for label, plan in variants:
            t = median(times[label])
            out.append([label, f"{t:.3f} s", f"{base / t:.2f}x", f"{counted[label]:,}",
                        f"{1 - counted[label] / counted['(a) across documents']:.1%}"])
        print(f"\nmean document length {mean}: {len(starts)} documents in the row, of mean length "
              f"{args.seq_len / len(starts):.0f}\n")
        print(table(["plan", "step (median)", "vs (a)", "score entries / layer / head", "skipped vs (a)"], out))
        t_doc, t_unsliced = median(times["doc-sliced"]), median(times["(b) unsliced, masked"])
        print(f"\ndoc-sliced saves {base - t_doc:.3f} s a step against (a) ({1 - t_doc / base:.0%}), "
              f"and {t_unsliced - t_doc:+.3f} s against (b)")
    print(f"\nCPU kernels for one slice's attention (documents of 512, {args.seq_len} keys, 8 heads of 64, fwd+bwd)\n")
    print(kernel_table(args.seq_len, 512))
    return 0


if __name__ == "__main__":
    sys.exit(main())
