"""`tpc`: the command line. Thin: each subcommand parses its arguments and calls one library
function. `main(argv) -> int` is testable in-process; `entry()` is the console script.

Errors a user can cause are `TpirError`s: printed with file:line:col and a hint, exit status 1,
no traceback unless --debug. Exit status 2 is for bad command-line arguments (argparse).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.semantics import DEFAULT_COMM, CommRules

DESCRIPTION = """\
tpc compiles a Transformer language model into a token-level pipeline-parallel training plan
(a readable .tpir file) and runs it.

typical use:
  tpc compile examples/gpt.py -o plan.tpir --stages 2 --microbatches 2 --seq-len 128 --batch 8
  tpc verify plan.tpir
  tpc show plan.tpir
  tpc simulate plan.tpir --unit --png timeline.png
  torchrun --nproc-per-node 2 --no-python tpc run plan.tpir --steps 20
  tpc run --interpret plan.tpir --verify-grads
  tpc verify schedule.csv              # a torch.distributed.pipelining schedule (docs/torch-pipelining.md)
  tpc compile examples/gpt.py -o plans --seq-len 32,64,128 --batch 8   # a plan bundle, one plan per length
  torchrun --nproc-per-node 2 --no-python tpc run plans --curriculum fixed_linear:32:128:100 --steps 200
"""


def _read_text(path: str) -> str:
    from tpc.ir.files import read_text

    return read_text(path)


# ------------------------------------------------------------------------------ subcommands


def cmd_verify(args) -> int:
    from tpc.compiler.torch_schedule.load import load_checked_plan
    from tpc.ir.verify.bundle import is_bundle, load_bundle

    if is_bundle(args.plan):
        bundle = load_bundle(args.plan, args.comm)
        for plan in bundle.plans:
            n = sum(len(r.instrs) for r in plan.ranks)
            print(f"{plan.source}: ok (seq {plan.header.shape.seq}, batch {plan.header.shape.batch}, "
                  f"{len(plan.ranks)} ranks, {n} instructions)")
        print(f"{args.plan}: ok (a plan bundle of {len(bundle.plans)} lengths, "
              f"{', '.join(map(str, bundle.lengths))}; one stage split)")
        return 0
    plan = load_checked_plan(args.plan, comm=args.comm)
    n = sum(len(r.instrs) for r in plan.ranks)
    print(f"{args.plan}: ok ({len(plan.ranks)} ranks, {plan.header.num_stages} stages, {n} instructions),"
          f" under {args.comm}'s rules")
    return 0


def cmd_fmt(args) -> int:
    from tpc.ir.parse import parse_document
    from tpc.ir.printer import print_document

    status = 0
    from tpc.ir.files import atomic_write_text, check_output

    # every file read, parsed and its folder checked before the first is rewritten: a bad file
    # (or a read-only folder) among several leaves all of them as they were
    changed = []
    for path in args.plans:
        text = _read_text(path)
        canonical = print_document(parse_document(text, file=path))
        if canonical != text:
            changed.append((path, canonical))
    if not args.check:
        for path, _ in changed:
            check_output(path, option="PLAN")
    for path, canonical in changed:
        if args.check:
            print(f"{path}: not canonical (run `tpc fmt {path}`)")
            status = 1
        else:
            atomic_write_text(path, canonical)  # a full disk leaves the hand-edited plan as it was
            print(f"{path}: reformatted")
    return status


def cmd_show(args) -> int:
    from tpc.ir.parse import parse
    from tpc.ir.show import render_grid
    from tpc.ir.verify.bundle import is_bundle, load_bundle

    if is_bundle(args.plan):
        bundle = load_bundle(args.plan)
        for k, plan in enumerate(bundle.plans):
            h = plan.header
            print(("\n" if k else "") + f"== {plan.source}: seq {h.shape.seq}, batch {h.shape.batch}, "
                  f"schedule {h.schedule.name}")
            print(render_grid(plan, width=args.width))
        return 0
    plan = parse(_read_text(args.plan), file=args.plan)
    print(render_grid(plan, width=args.width))
    return 0


def _lazy(module: str, name: str):
    """A subcommand's function, imported when it runs (`tpc --help` need not import torch)."""

    def run(args) -> int:
        import importlib

        return getattr(importlib.import_module(module), name)(args)

    return run


cmd_compile = _lazy("tpc.cli.compile", "cmd_compile")
cmd_run = _lazy("tpc.cli.run", "cmd_run")
cmd_simulate = _lazy("tpc.cli.simulate", "cmd_simulate")
cmd_profile = _lazy("tpc.cli.profile", "cmd_profile")
cmd_export = _lazy("tpc.cli.export", "cmd_export")
cmd_sample = _lazy("tpc.cli.export", "cmd_sample")
cmd_export_schedule = _lazy("tpc.cli.export", "cmd_export_schedule")


# --------------------------------------------------------------------------------- parsers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tpc", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    from tpc.compiler.lowering.lower import Exchanges
    from tpc.compiler.options import DEFAULTS as D
    from tpc.compiler.pipeline import PASS_NAMES

    c = sub.add_parser(
        "compile",
        help="compile a model file into a verified .tpir plan",
        description="Capture MODEL with torch.export, cut it into pipeline stages that run one token "
        "slice at a time, choose micro-batches and token slices, build the schedule and write a "
        "verified per-rank plan.",
    )
    c.add_argument("model", help="Python file defining a zero-argument callable that returns the model")
    c.add_argument("-o", "--output", required=True, help="where to write the plan (.tpir); with several "
                   "--seq-len lengths, the folder of the plan bundle (index.tpir and one seqL.tpir per length)")
    c.add_argument("--factory", default=D["factory"], help=f"name of the callable in MODEL (default: {D['factory']})")
    c.add_argument("--stages", default=None, help=f"pipeline stages K, or 'auto' to search pipeline × data splits of --ranks (default: {D['stages']}, or what --schedule-file runs)")
    c.add_argument("--microbatches", default=None, help=f"micro-batches per step, or 'auto': the optimiser's batch knapsack chooses their number and sizes (needs --slices auto and a cost model) (default: {D['microbatches']}, or what --schedule-file names)")
    c.add_argument("--seq-len", required=True, help="training sequence length L; or several, comma-separated "
                   "(e.g. 64,128,256,512): a plan bundle, one plan per length sharing one stage split, "
                   "written into the folder -o names (for `tpc run --curriculum`)")
    c.add_argument("--constant-tokens", action="store_true", help="with several --seq-len: give each shorter "
                   "length --batch x longest / length sequences, so every step has the same tokens "
                   "(for `tpc run --curriculum-type seqlen_reshape`); default: --batch at every length "
                   "(seqlen_truncate)")
    c.add_argument("--batch", type=int, required=True, help="global batch size (sequences per step)")
    c.add_argument("--slices", default=D["slices"], help=f"token slices per micro-batch: N (equal), l1,l2,... (lengths summing to L), or 'auto' (the optimiser chooses) (default: {D['slices']})")
    c.add_argument("--schedule", default=None, help=f"gpipe | 1f1b | terapipe | seq1f1b | interleaved | looped-bfs | zb-h1 | zb-h2 | seq-zb | seq-interleaved | zbv | dualpipev | chimera (two pipelines over weight replicas) | chimera-doubling (chimera, two micro-batches' forwards together) | 1f1b-pre-recompute | 1f1b-last-no-recompute | 1f1b-critical-path (Merak's critical-path 1F1B: they place their own recomputation) | auto (with --recompute full it compares Merak's too; default: {D['schedule']}; docs/schedules.md)")
    c.add_argument("--virtual-stages", type=int, default=D["virtual_stages"], metavar="V", help=f"stages per pipeline rank: --stages K ranks hold K x V stages, stage s on rank s mod K (interleaved, looped-bfs, ...; default: {D['virtual_stages']}). Also: --stages K --ranks R with R / dp dividing K")
    c.add_argument("--recompute", default=D["recompute"], choices=("none", "full", "auto"), help=f"activation recomputation: none; full (every forward keeps only its input, a `recompute` rebuilds it before the backward); auto (per stage, the fewest stages that make every rank fit --memory-per-rank; needs a cost model) (default: {D['recompute']})")
    c.add_argument("--schedule-file", default=None, help="a torch.distributed.pipelining schedule CSV (_dump_csv) giving the compute order, stages, their ranks and the micro-batches (docs/torch-pipelining.md)")
    c.add_argument("--dp", type=int, default=D["dp"], help=f"data-parallel replicas (default: {D['dp']})")
    c.add_argument("--tensor", default=None, help=f"tensor-parallel ranks per stage T (Megatron's split: attention by heads, MLPs column -> row, embedding and head by vocabulary rows), found in each stage's graph and checked at compile: a T that does not divide the heads, a hidden width or the vocabulary is refused at the model's line. The plan's mesh is `pipe P data D tensor T` (P x D x T ranks); the cost model divides the split compute by T and adds the tensor group's all-reduces on the node's link (a --cost profile was measured unsplit: its compute is divided by T likewise). 'auto' with --stages auto --ranks N: the search splits N into pipeline x data x tensor (default: {D['tensor']}; docs/parallelism.md)")
    c.add_argument("--sequence-parallel", action="store_true", default=None, help="with --tensor T: Megatron's "
                   "sequence parallelism: between the tensor-parallel regions (norms, residual adds, the stage's "
                   "output) each tensor rank holds 1/T of a slice's tokens, and the messages between stages carry "
                   "1/T of them; every slice's length must divide by T. The mesh line gets `sequence-parallel` "
                   "(format version 5; docs/parallelism.md)")
    c.add_argument("--tensor-overlap", action="store_true", default=None, help="with --tensor T: bring the "
                   "forwards of token slices i and i+1 of each stage together in every rank's stream (i+1's "
                   "receive before i's forward, i's send after i+1's), so that the two run as one program in "
                   "which each slice's tensor-parallel collectives run while the other slice computes "
                   "(Merak's sub-pipelined tensor parallelism, with the slices as the sub-pipelines). The "
                   "same numbers, bit for bit; the schedule line says so in a comment (docs/parallelism.md)")
    c.add_argument("--ranks", type=int, default=D["ranks"], help="total ranks: with --stages auto, the search splits them into pipeline x data (x tensor, with --tensor); else stages x dp x tensor, or fewer for several stages per rank (R / (dp x tensor) dividing --stages, placed as the schedule needs)")
    c.add_argument("--cost", default=D["cost"], help="measured cost profile (.msgpack from `tpc profile`) for --slices/--schedule auto")
    c.add_argument("--device-model", default=D["device_model"], help="analytic cost model instead of a profile: v100 | a100 | h100 | h200 | a spec file")
    c.add_argument("--shard-optimizer", action="store_true", help="plan for `tpc run --shard-optimizer`: "
                   "--memory-per-rank fitting and --schedule auto count 1/d of the optimizer state per rank "
                   "(d: data-parallel size)")
    c.add_argument("--memory-per-rank", default=D["memory_per_rank"], help="memory budget per rank for --schedule auto, e.g. 16GiB")
    c.add_argument("--documents", default=None, metavar="eos:ID",
                   help="the rows are packed documents ended by token ID: positions restart and attention stays "
                        "inside each document, the target after a separator is not predicted (the plan's "
                        "`documents` line; run it with the same --documents; docs/training.md, 'Packed documents')")
    c.add_argument("--document-length", default=None, metavar="N|FILE",
                   help="with --documents: the corpus's mean document length in tokens, or a token file to measure "
                        "it in; the cost model prices attention by it (default: the row's length)")
    c.add_argument("--random-ltd", metavar="UNITS", help="random layerwise token dropping (DeepSpeed's "
                   "random-LTD): units A:B (or a comma list, middle units only) drop tokens; the plan records them "
                   "and the kept-token schedule (its `random-ltd` line), the cost model prices the thinner units "
                   "and `tpc run` drops as the plan says (docs/training.md)")
    c.add_argument("--random-ltd-schedule", metavar="S", help="with --random-ltd: the kept tokens per sequence, "
                   "MIN,MAX,REQUIRE_STEPS[,SEQ_PER_STEP] (DeepSpeed's fixed_linear), or DeepSpeed's "
                   "random_ltd_schedule JSON (text, or a .json file holding it at any depth)")
    c.add_argument("--explain", action="store_true", help="print the candidates the optimiser considered and why it chose")
    c.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    c.add_argument("--comm", type=CommRules, choices=tuple(CommRules), default=D["comm"], help=f"the backend the plan is for, whose communication rules it is lowered, searched and verified under (default: {D['comm']}): nccl (CUDA: a send completes only when its receive is posted, so sends and receives that two ranks must post together become one `exchange`) or gloo (CPU: buffered sends, no exchanges needed). A plan for nccl also runs on gloo (docs/training.md, 'Communication')")
    c.add_argument("--exchanges", default=None, choices=tuple(e.value for e in Exchanges), help=f"with --comm nccl, how the sends and receives two or more ranks must post at the same time are written (default: {D['exchanges']}): batched (one `exchange N`, issued as one batch_isend_irecv, both directions' transfers overlapping) or ordered (single sends and receives, in an order NCCL's rules run without a batch: in a pair of ranks the lower sends first; for GPUs on which batched exchanges hang; docs/training.md, 'Communication')")
    c.add_argument("--print-after", action="append", default=None, metavar="PASS",
                   help="print the IR (canonical .tpir text, on stdout) after the pass PASS; several: "
                   "repeat the flag or separate names by commas; 'all': after every pass. The passes, in "
                   f"order: {', '.join(PASS_NAMES)} (with --schedule-file: load, trace, partition, header, "
                   "csv-place, self-check, csv-import, eval). docs/debugging.md, 'The passes of tpc compile'")
    c.set_defaults(func=cmd_compile)

    v = sub.add_parser("verify", help="check a plan: dependencies, matching sends, deadlock freedom",
                       description="Check every rule of the plan format and report every error with file:line:col.")
    v.add_argument("plan", help="a .tpir file, a plan bundle (its folder or index.tpir: every plan, and that "
                   "they share one model and stage split), or a torch.distributed.pipelining schedule .csv")
    v.add_argument("--comm", type=CommRules, choices=tuple(CommRules), default=DEFAULT_COMM, help=f"check deadlock freedom under this backend's rules (default: {DEFAULT_COMM}): nccl (a send completes only when its receive is posted, one FIFO per rank pair, an `exchange` completes together) or gloo (buffered sends). A deadlock is reported with the ranks and lines of the wait cycle")
    v.set_defaults(func=cmd_verify)

    f = sub.add_parser("fmt", help="rewrite plans in canonical form",
                       description="Re-print each plan canonically (after a hand edit).")
    f.add_argument("plans", nargs="+", help=".tpir files (plans, or a plan bundle's index.tpir)")
    f.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is not canonical")
    f.set_defaults(func=cmd_fmt)

    s = sub.add_parser("show", help="print a plan as a steps × ranks grid",
                       description="Print each rank's compute order side by side, one row per step, communication left out.")
    s.add_argument("plan", help="a .tpir file, or a plan bundle (each of its plans in turn)")
    s.add_argument("--width", type=int, default=0, help="column width (default: fit the widest cell)")
    s.set_defaults(func=cmd_show)

    sim = sub.add_parser("simulate", help="predict a plan's timeline, bubble and memory",
                         description="Discrete-event simulation of a plan under a cost model.")
    sim.add_argument("plan", help="a .tpir file, a plan bundle (each plan, then their step times side by "
                     "side), or a torch.distributed.pipelining schedule .csv (with --unit)")
    g = sim.add_mutually_exclusive_group()
    g.add_argument("--cost", help="measured cost profile (.msgpack from `tpc profile`)")
    g.add_argument("--device-model", help="analytic cost model: v100 | a100 | h100 | h200 | a spec file")
    g.add_argument("--unit", action="store_true", help="unit costs: forward 1, backward 2 per slice (scaled by slice length)")
    sim.add_argument("--trace", help="write a Chrome-trace JSON (opens in Perfetto)")
    sim.add_argument("--png", help="write a Gantt chart picture")
    sim.add_argument("--shard-optimizer", action="store_true", help="predict the memory of a run with "
                     "`tpc run --shard-optimizer`: each rank keeps 1/d of the optimizer state (d: data-parallel size)")
    sim.add_argument("--compare", help="a measured trace from `tpc run --trace`: print predicted vs measured")
    sim.add_argument("--comm", type=CommRules, choices=tuple(CommRules), default=DEFAULT_COMM,
                     help="the rules messages move under, and the plan is checked under: nccl (each "
                     "rank's sends and receives run in issue order, and a message moves only once both "
                     "its ends have started; what a run on GPUs does, and what `tpc compile`'s search "
                     "predicts) or gloo (buffered sends: a send never waits, its transfer overlaps the "
                     f"receiver's work) (default: {DEFAULT_COMM}, as `tpc compile` and `tpc verify`)")
    sim.set_defaults(func=cmd_simulate)

    # the run flags' defaults are RunOptions' own (filled in by tpc.cli.run.options_from_args);
    # the "(default: ...)" of each help text says the same (tests/cli/test_run_defaults.py)
    r = sub.add_parser("run", help="execute a plan (under torchrun, or --interpret in one process)",
                       description="Run a plan: under torchrun one process per rank (NCCL on CUDA, gloo on CPU), "
                       "or with --interpret all ranks in this process (the reference interpreter).")
    r.add_argument("plan", help="a .tpir file, or a plan bundle (with --curriculum)")
    r.add_argument("--curriculum", metavar="SCHEDULE", help="a sequence-length curriculum over a plan bundle "
                   "(DeepSpeed Data Efficiency's): fixed_linear:START:END:STEPS (the length grows linearly "
                   "from START to END over STEPS steps), fixed_root:START:END:STEPS[:DEGREE] (as the "
                   "DEGREE-th root, default 2), or fixed_discrete:L1,L2,...:S1,S2,... (L1 up to step S1, "
                   "L2 up to S2, ..., the last after). Lengths are DeepSpeed's (multiples of 8) rounded down "
                   "to the bundle's; each step runs its length's plan in the same processes "
                   "(docs/training.md)")
    r.add_argument("--curriculum-type", default="seqlen_truncate", choices=("seqlen_truncate", "seqlen_reshape"),
                   help="how a step's batch is cut to its length: seqlen_truncate keeps the first L tokens of "
                   "each sequence; seqlen_reshape cuts each sequence into sequences of L, so every step has the "
                   "same tokens (a bundle compiled with --constant-tokens) (default: seqlen_truncate)")
    r.add_argument("--interpret", action="store_true", help="run every rank in this process with the reference interpreter")
    r.add_argument("--steps", type=int, default=None, help="training steps (default: 1)")
    r.add_argument("--comm", type=CommRules, choices=tuple(CommRules), default=None, help="the communication rules to run under and verify the plan for (default: the backend's own: nccl on CUDA, gloo on the CPU and with --interpret). --comm nccl on the CPU runs NCCL's rules with the interpreter or gloo: a send completes only when its receive is posted, an `exchange` is one batch, so a plan that would hang on GPUs hangs (and is reported) here (docs/training.md, 'Communication')")
    r.add_argument("--verify-grads", action="store_true", help="compare loss and gradients with plain autograd on the unsliced model; exit 1 above --tolerance")
    r.add_argument("--tolerance", type=float, default=None, help="largest relative gradient error for --verify-grads (default: 1e-5)")
    r.add_argument("--documents", default=None, metavar="eos:ID",
                   help="the token file's rows are packed documents ended by token ID (the plan must be compiled "
                        "with the same --documents): rows start at a document, every stage reads the boundaries")
    r.add_argument("--data", help="token file (.bin of uint16 ids, see examples/prepare_corpus.py); default: random tokens from --seed")
    r.add_argument("--seed", type=int, default=None, help="seed for weights and batches (default: 0)")
    r.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 3e-4)")
    r.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay on matrices (default: 0.1)")
    r.add_argument("--lr-schedule", default=None, choices=("cosine", "constant"),
                   help="cosine: linear warm-up over --warmup steps, then half a cosine down to a tenth "
                   "of --lr at --steps; constant: --lr throughout (default: cosine)")
    r.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default: 0)")
    r.add_argument("--grad-clip", type=float, default=None, help="global gradient-norm clip, 0 for none (default: 0)")
    r.add_argument("--optimizer", default=None, help="adamw | sgd (default: adamw)")
    r.add_argument("--device", default=None, help="cpu | cuda | auto (default: auto: cuda when present)")
    r.add_argument("--bf16", action="store_true", help="bf16 autocast on CUDA (fp32 master weights)")
    r.add_argument("--shard-optimizer", action="store_true", help="shard the optimizer state and update over "
                   "each stage's data-parallel replicas (ZeRO-1): reduce-scatter of the gradients, the step on "
                   "each replica's share, all-gather of the weights; AdamW's state per rank divided by the "
                   "data-parallel size (docs/training.md)")
    r.add_argument("--timeout", type=float, default=None, help="seconds a rank waits for a peer before giving up (default: 120)")
    r.add_argument("--trace", help="write the measured per-instruction timeline (Chrome-trace JSON)")
    r.add_argument("--metrics", help="write one JSON line of metrics per step")
    r.add_argument("--checkpoint-dir", help="directory for checkpoints")
    r.add_argument("--save-every", type=int, default=None, help="with --checkpoint-dir, save a checkpoint every N steps and after the last (default: 0, only after the last)")
    r.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir, "
                   "written by this plan or any other plan of the same model")
    r.add_argument("--init-from", metavar="PATH", help="start from these weights: a state_dict .pt (read "
                   "weights-only), a .safetensors file, a Hugging Face model directory (config.json + "
                   "safetensors) or a checkpoint directory")
    r.add_argument("--eval-data", metavar="FILE", help="validation token file (e.g. data/val.bin from "
                   "examples/prepare_corpus.py): the plan's forward-only evaluation program gives the "
                   "validation loss and perplexity before the first step, every --eval-every steps and "
                   "after the last, in the progress line and --metrics")
    r.add_argument("--eval-every", type=int, default=None, metavar="N", help="evaluate every N steps "
                   "(default: 0, only before the first and after the last step)")
    r.add_argument("--eval-batches", type=int, default=None, metavar="K", help="validation batches per "
                   "evaluation, each of the plan's batch x seq, the same K every time (default: 4)")
    r.add_argument("--save-best", action="store_true", help="also keep the checkpoint of the lowest "
                   "validation loss, as DIR/best beside DIR/latest (needs --checkpoint-dir, --eval-data)")
    r.add_argument("--random-ltd", metavar="UNITS", help="random layerwise token dropping (DeepSpeed's "
                   "random-LTD): units A:B (or a comma list, middle units only) run each slice on a random "
                   "sorted subset of its tokens, drawn per step, data replica, micro-batch, unit and slice from a "
                   "seeded generator; the others skip them (docs/training.md). A plan compiled with --random-ltd "
                   "says it already: a flag that disagrees with its plan is refused")
    r.add_argument("--random-ltd-schedule", metavar="S", help="the kept tokens per sequence: "
                   "MIN,MAX,REQUIRE_STEPS[,SEQ_PER_STEP] (DeepSpeed's fixed_linear: from min_value to max_value "
                   "over require_steps, a multiple of seq_per_step), or DeepSpeed's random_ltd_schedule JSON")
    r.add_argument("--allow-nonfinite-loss", action="store_true", help="train on when a step's loss "
                   "is nan or inf (by default the run stops there, before anything of that step is saved)")
    r.add_argument("--compile", action="store_true", help="run every stage through its programs (its "
                   "forward, backward and split backward, cut from one traced graph) compiled by torch.compile's "
                   "inductor, for every slice shape of the plan, before step 1 (progress shown). Fewer, fused "
                   "kernels and far fewer host operations per slice; the compiled code is cached on disk "
                   "(TORCHINDUCTOR_CACHE_DIR), so a second run compiles nothing it compiled before. See docs/compile.md")
    r.add_argument("--no-slice-pairs", dest="slice_pairs", action="store_false", help="with a tensor axis: "
                   "run every slice's forward and backward alone, its tensor collectives blocking, instead of "
                   "running two adjacent computes of consecutive slices (what `tpc compile --tensor-overlap` "
                   "arranges) as one program whose collectives overlap the other slice's compute. The values "
                   "are the same either way; see docs/parallelism.md")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    r.set_defaults(func=cmd_run)

    pr = sub.add_parser("profile", help="measure a model's per-stage slice costs",
                        description="Time forward and backward of the model's units over slice length × context × micro-batch size, fit the cost model and save it.")
    pr.add_argument("model", help="Python model file")
    pr.add_argument("-o", "--output", required=True, help="where to write the profile (.msgpack)")
    pr.add_argument("--factory", default="model", help="name of the callable in MODEL (default: model)")
    pr.add_argument("--seq-len", type=int, required=True, help="longest sequence to profile")
    pr.add_argument("--device", default="cpu", help="cpu | cuda (default: cpu)")
    pr.add_argument("--batch-sizes", default="1,2,4", help="micro-batch sizes to measure (default: 1,2,4)")
    pr.add_argument("--compile", action="store_true", help="time the units' stage programs compiled by inductor, "
                    "as `tpc run --compile` runs them, so that `tpc compile --cost` slices for what a compiled "
                    "slice costs. Every grid point is a slice shape of its own, compiled once (slow on a CPU: "
                    "minutes per unit); the stash stays eager autograd's. See docs/compile.md")
    pr.set_defaults(func=cmd_profile)

    ex = sub.add_parser("export", help="write a checkpoint as a plain state_dict of the unsliced model",
                        description="Gather every stage's parameters from a checkpoint into one state_dict "
                        "that loads into the model file's model() with load_state_dict: a .pt, a "
                        ".safetensors file, or, for a Hugging Face model, a directory from_pretrained loads.")
    ex.add_argument("checkpoint", help="a checkpoint directory written by `tpc run --checkpoint-dir`")
    ex.add_argument("-o", "--output", required=True, help="where to write: model.pt, model.safetensors, or a "
                    "directory (a Hugging Face model)")
    ex.add_argument("--format", choices=("pt", "safetensors", "hf"), default=None,
                    help="pt | safetensors | hf (default: from the suffix of -o; none: hf)")
    ex.set_defaults(func=cmd_export)

    es = sub.add_parser("export-schedule", help="write a plan's schedule as a torch.distributed.pipelining CSV",
                        description="Write each rank's compute order (and, with --format compute_comms, its sends "
                        "and receives) in the CSV torch's _PipelineScheduleRuntime._load_csv reads, with a map "
                        "of token slices to torch micro-batch indices beside it (SCHED.csv.map.json).")
    es.add_argument("plan", help="a .tpir file (or a torch schedule .csv)")
    es.add_argument("-o", "--output", required=True, help="where to write the schedule (.csv)")
    es.add_argument("--format", default="compute_only", choices=["compute_only", "compute_comms"],
                    help="compute_only: torch adds the communication (its _load_csv default); compute_comms: "
                    "the plan's own sends and receives (default: compute_only)")
    es.set_defaults(func=cmd_export_schedule)

    sa = sub.add_parser("sample", help="generate text from a checkpoint",
                        description="Load a checkpoint into the unsliced model and generate bytes after a prompt.")
    sa.add_argument("checkpoint", help="a checkpoint directory, or a .pt state_dict from `tpc export`")
    sa.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    sa.add_argument("--tokens", type=int, default=200, help="tokens to generate (default: 200)")
    sa.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, 0 for greedy (default: 0.8)")
    sa.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens, 0 for all (default: 0)")
    sa.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    sa.add_argument("--model", help="model file, for a .pt without its .pt.json beside it")
    sa.add_argument("--factory", help="factory in --model (default: the one recorded, else model)")
    sa.set_defaults(func=cmd_sample)
    return p


_NEGATIVE = re.compile(r"-\.?\d")


def negative_values(argv: list[str]) -> list[str]:
    """`--flag -X` written `--flag=-X` where -X begins like a negative number (`-5,64`, `-1e-3`,
    `-5GiB`). argparse reads only plain negative numbers (`-5`, `-0.5`) as values; anything
    else starting with `-` it takes for an option, and refuses the flag as missing its argument
    ("expected one argument"), where the value's own check says it is negative, at its flag."""
    out: list[str] = []
    for k, token in enumerate(argv):
        previous = argv[k - 1] if k else ""
        if (_NEGATIVE.match(token) and out and out[-1] == previous and previous.startswith("--")
                and "=" not in previous and previous != "--"):
            out[-1] = f"{previous}={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(negative_values(sys.argv[1:] if argv is None else list(argv)))
    try:
        return args.func(args)
    except TpirError as e:
        if args.debug:
            raise
        print(e.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        # a save that was cut says what it kept (executors/training/checkpoint.py)
        print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`tpc show plan.tpir | head`): not an error of ours; point stdout
        # at devnull so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    sys.exit(status)


if __name__ == "__main__":
    entry()
