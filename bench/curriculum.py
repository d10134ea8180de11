"""The sequence-length curriculum on the README's model and corpus: time to a fixed loss with and
without it, and each length's step time against the unsliced plan.

The model is examples/gpt.py, the corpus the Python standard library's sources
(examples/prepare_corpus.py, 4 MB as scripts/demo.sh makes it), trained as the README does:
2 pipeline stages on 2 gloo ranks under torchrun, 2 micro-batches, batch 16, AdamW at lr 3e-3
with 20 warm-up steps and cosine decay, clipping at 1.0, slices chosen by the optimiser from a
CPU profile (`tpc profile`, run first).

1. Time to a fixed loss. Two runs of `--steps` steps from the same weights on the same data:
   the plain plan at length 128, and the plan bundle 32,64,128 under `--curriculum
   fixed_linear:32:128:STEPS/2` (seqlen_truncate, or --type seqlen_reshape with a bundle of
   constant tokens). Each saves a checkpoint every `--every` steps. The loss measured is a
   held-out loss computed here: the mean next-token cross-entropy of each checkpoint's
   unsliced model on 4 fixed batches of 16 x 128 tokens of val.bin (text the runs never train
   on), at the full length 128. A run's time at a checkpoint is the sum of its logged step times
   up to it (training only: start-up, checkpoint writing and the evaluation are not counted).
   The fixed loss is the held-out loss the plain run reaches at 80% of its steps (or --target).
2. Per-length step times: in two fresh gloo processes, blocks of steps alternate between the
   bundle's plan of each length (the optimiser's slices) and the unsliced plan of that length
   (--slices 1, same stages and micro-batches); medians side by side, the first step of every
   block left out. The curriculum run's own median step time per length is printed with them.

    OMP_NUM_THREADS=1 python bench/curriculum.py [--steps 200] [--every 20] [--type seqlen_truncate]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, ROOT, at_root, compile_plan, cpu_profile, launch, load_note, median, rank_alternate, table  # noqa: E402

MODEL = "examples/gpt.py"
LENGTHS = (32, 64, 128)
BATCH = 16
TRAIN = ["--device", "cpu", "--lr", "3e-3", "--warmup", "20", "--grad-clip", "1.0", "--seed", "0", "-q"]
EVAL_BATCHES = 4


def torchrun(args: list[str], log: Path) -> float:
    """`torchrun --nproc-per-node 2 --no-python tpc ARGS`; its wall time."""
    tpc = str(Path(sys.executable).with_name("tpc"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--no-python",
           "--log-dir", str(log.with_suffix("")), "--redirects", "3", tpc, *args]
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                          capture_output=True, text=True, cwd=ROOT)
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}); see {log}:\n{(done.stdout + done.stderr)[-3000:]}")
    return time.monotonic() - t0


def rows_of(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def held_out(ck: Path, val: str) -> dict[int, float]:
    """step -> held-out loss of every checkpoint under `ck` (module docstring)."""
    import torch
    import torch.nn.functional as F

    from tpc.compiler.frontend import load_model
    from tpc.executors.training.export import export_state_dict
    from tpc.executors.training.token_file import TokenFileBatches

    source = TokenFileBatches(val, seed=1234, batch=BATCH, seq=LENGTHS[-1], vocab=256)
    batches = [source.get(i) for i in range(EVAL_BATCHES)]
    model = load_model(MODEL, "model")
    out = {}
    for step_dir in sorted(ck.glob("step_*")):
        sd, meta = export_state_dict(step_dir)
        model.load_state_dict(sd)
        model.eval()
        with torch.no_grad():
            losses = [float(F.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())) for t in batches]
        out[int(meta["step"])] = sum(losses) / len(losses)
    return out


def time_to(losses: dict[int, float], elapsed: dict[int, float], target: float):
    """(step, seconds) of the first checkpoint at or below `target`, or None."""
    for step in sorted(losses):
        if losses[step] <= target:
            return step, elapsed[step]
    return None


def slices_text(plan_path: str) -> str:
    from tpc.ir.verify import verify_file

    mbs = verify_file(plan_path).header.microbatches
    return " / ".join(" ".join(str(hi - lo) for lo, hi in m.slices) for m in mbs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="steps of each training run (default: 200)")
    ap.add_argument("--every", type=int, default=20, help="checkpoint (and evaluate) every N steps (default: 20)")
    ap.add_argument("--type", default="seqlen_truncate", choices=("seqlen_truncate", "seqlen_reshape"),
                    help="--curriculum-type of the curriculum run (default: seqlen_truncate)")
    ap.add_argument("--target", type=float, help="the fixed held-out loss (default: the plain run's at 80%% of its steps)")
    ap.add_argument("--repeats", type=int, default=3, help="alternations per length in part 2 (default: 3)")
    ap.add_argument("--block", type=int, default=3, help="timed steps per block in part 2 (default: 3)")
    ap.add_argument("--work", help="keep the corpus, profile, plans and runs in this folder (default: a temporary one)")
    args = ap.parse_args(argv)
    at_root()
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        data = work / "data"
        if not (data / "train.bin").is_file():
            subprocess.run([sys.executable, "examples/prepare_corpus.py", "-o", str(data), "--max-bytes", "4000000"],
                           check=True, capture_output=True)
        profile = work / "profile.msgpack"
        if not profile.is_file():
            cpu_profile(MODEL, "model", LENGTHS[-1], profile, batch=BATCH // 2)
        common = dict(stages=2, microbatches=2, batch=BATCH, schedule="seq1f1b")
        plain = compile_plan(MODEL, work / "plan.tpir", seq_len=LENGTHS[-1], slices="auto", cost=profile, **common)
        lengths = ",".join(map(str, LENGTHS))
        reshape = ["--constant-tokens"] if args.type == "seqlen_reshape" else []
        from tpc.cli.main import main as tpc

        for name, slices in (("bundle", "auto"), ("unsliced", "1")):
            argv_ = ["compile", MODEL, "-o", str(work / name), "--seq-len", lengths, "--slices", slices, "--cost",
                     str(profile), "-q", *[f"--{k}={v}" for k, v in common.items()], *reshape]
            if tpc(argv_) != 0:
                raise RuntimeError(f"tpc {' '.join(argv_)} failed")
        print(f"  setup: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

        # 1. time to a fixed held-out loss
        spec = f"fixed_linear:{LENGTHS[0]}:{LENGTHS[-1]}:{max(1, args.steps // 2)}"
        runs = {"plain (length 128)": [plain], f"curriculum {spec}": [str(work / "bundle"), "--curriculum", spec,
                                                                     "--curriculum-type", args.type]}
        results = {}
        for k, (name, head) in enumerate(runs.items()):
            ck, metrics = work / f"ck{k}", work / f"m{k}.jsonl"
            wall = torchrun(["run", *head, "--steps", str(args.steps), "--data", str(data / "train.bin"), *TRAIN,
                             "--checkpoint-dir", str(ck), "--save-every", str(args.every), "--metrics", str(metrics)],
                            work / f"run{k}.log")
            rows = rows_of(metrics)
            elapsed, total = {}, 0.0
            for r in rows:
                total += r["step_time"]
                elapsed[r["step"]] = total
            results[name] = dict(rows=rows, elapsed=elapsed, losses=held_out(ck, str(data / "val.bin")), wall=wall)
            print(f"  {name}: {wall:.0f} s", file=sys.stderr, flush=True)
        base, cur = results.values()
        at = max(s for s in base["losses"] if s <= 0.8 * args.steps)
        target = args.target if args.target is not None else base["losses"][at]

        # 2. per-length step times, sliced vs unsliced, side by side in the same processes
        pairs = [(str(work / "unsliced" / f"seq{L}.tpir"), str(work / "bundle" / f"seq{L}.tpir")) for L in LENGTHS]
        measured = launch(2, rank_alternate, pairs, args.repeats, args.block)[0]
        slicing = [slices_text(sliced) for _, sliced in pairs]

    print(f"sequence-length curriculum on {MACHINE}: {MODEL} (4 layers, width 256), corpus of "
          f"examples/prepare_corpus.py (4 MB), 2 stages on 2 gloo ranks under torchrun, batch {BATCH}, "
          f"2 micro-batches, seq1f1b; {args.steps} steps each; {load_note()}")
    print(f"\n1. held-out loss (val.bin, {EVAL_BATCHES} batches of {BATCH} x {LENGTHS[-1]}) by training time; "
          f"target {target:.4f}" + ("" if args.target is not None else f" (the plain run's at step {at})"))
    rows = []
    for step in sorted(base["losses"]):
        rows.append([step, f"{base['elapsed'][step]:.1f}", f"{base['losses'][step]:.4f}",
                     cur["rows"][step - 1].get("seq", "-"), f"{cur['elapsed'][step]:.1f}", f"{cur['losses'][step]:.4f}"])
    print(table(["step", "plain: s", "plain: loss", "curriculum: length", "curriculum: s", "curriculum: loss"], rows))
    reached = {name: time_to(r["losses"], r["elapsed"], target) for name, r in results.items()}
    for name, hit in reached.items():
        print(f"  {name}: " + (f"reaches {target:.4f} at step {hit[0]}, after {hit[1]:.1f} s of training"
                               if hit else f"does not reach {target:.4f} in {args.steps} steps"))
    (bname, bhit), (cname, chit) = reached.items()
    if bhit and chit:
        print(f"  time to the target: plain / curriculum = {bhit[1] / chit[1]:.2f}x")
    tokens = lambda r: sum(x["tokens_per_s"] * x["step_time"] for x in r["rows"])  # noqa: E731
    print(f"  tokens trained: plain {tokens(base):,.0f}, curriculum {tokens(cur):,.0f}; final held-out loss "
          f"plain {base['losses'][max(base['losses'])]:.4f}, curriculum {cur['losses'][max(cur['losses'])]:.4f}")
    print(f"  whole runs (start-up, tracing every length, checkpoints included): plain {base['wall']:.0f} s, "
          f"curriculum {cur['wall']:.0f} s")

    print(f"\n2. step time per length: the bundle's plan (optimiser's slices) vs the unsliced plan, "
          f"{args.repeats} x {args.block} alternating steps each (random tokens, SGD), and the curriculum run's median")
    rows = []
    for L, slices, times in zip(LENGTHS, slicing, measured):
        t_u, t_s = median(times[0]), median(times[1])
        in_run = [r["step_time"] for r in cur["rows"] if r.get("seq") == L]
        rows.append([L, slices, f"{t_u * 1e3:.0f}", f"{t_s * 1e3:.0f}", f"{t_u / t_s:.2f}x",
                     f"{median(in_run) * 1e3:.0f}" if in_run else "-"])
    print(table(["length", "slices (per micro-batch)", "unsliced ms", "bundle ms", "unsliced / bundle",
                 "curriculum run ms"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
