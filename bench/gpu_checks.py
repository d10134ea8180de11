"""The first-GPU checklist of docs/training.md in one run: plans through NCCL with the gradient
check (fp32 and bf16), the reference interpreter on CUDA, (unless --no-slicing)
bench/gpu_slicing.py, (unless --no-ssm) bench/ssm_slicing.py, (unless --no-overlap)
bench/tensor_overlap.py on 2 ranks, and (unless --no-score-transforms)
bench/score_transforms.py in fp32 and
bf16: the written-out soft-capping and sink attention against FlexAttention, forward and
backward, compiled (on the CPU: fp32, --quick). Prints one line per check and a Markdown table for docs/benchmarks.md.
First, bench/nccl_probe.py runs the plans' communication patterns in plain torch.distributed on
2 ranks, so that a plan that hangs can be told from a backend or set-up that cannot run the
pattern at all.

On a machine with fewer GPUs than a plan has ranks (one GPU, say), each rank runs as its own
torchrun "node" of one process, and each node gets its own `NCCL_HOSTID`. NCCL then takes the
ranks for separate hosts: it lets them share the one GPU (it refuses two ranks of one host on
one device) and carries their messages over its socket transport instead of NVLink. Same
send/receive rendezvous, same collectives, slower links. With enough GPUs the ranks are the
processes of one node, one GPU each (`--nproc-per-node`).

    python bench/gpu_checks.py [--out DIR] [--no-slicing] [--no-score-transforms]

A smoke run on a CPU (gloo, the same launches; the bf16 checks are skipped there):

    OMP_NUM_THREADS=1 python bench/gpu_checks.py --device cpu --no-slicing --no-score-transforms --only 1f1b
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import at_root, table  # noqa: E402

MODEL = "examples/gpt.py"
BASE = dict(seq_len=128, batch=8, microbatches=4, slices=2)
# name: compile options beyond BASE. Each plan runs fp32 with --verify-grads; BF16 ones also bf16.
PLANS = {
    "seq1f1b": dict(stages=2),
    "1f1b": dict(stages=2, schedule="1f1b"),
    "terapipe": dict(stages=2, schedule="terapipe", slices=4),
    "zb-h1": dict(stages=2, schedule="zb-h1"),
    "interleaved": dict(stages=4, ranks=2, schedule="interleaved"),
    "zbv": dict(stages=4, ranks=2, schedule="zbv"),
    "dualpipev": dict(stages=4, ranks=2, schedule="dualpipev"),
    "1f1b-dp2": dict(stages=2, dp=2, schedule="1f1b"),
    # two pipelines over weight replicas (reduce-replicas on NCCL); chimera refuses tied weights
    "chimera": dict(stages=2, schedule="chimera", model="bench/models/gpt_untied.py"),
    # each stage split over 2 tensor ranks (4 processes): the tensor collectives on NCCL
    "1f1b-tp2": dict(stages=2, tensor=2, schedule="1f1b"),
    # and with sequence parallelism: the messages a rank's half of each slice's tokens
    "seq1f1b-tp2-sp": dict(stages=2, tensor=2, sequence_parallel=True),
    # a split backward with a tensor axis: each rank's programs traced through its collectives
    "zb-h1-tp2": dict(stages=2, tensor=2, schedule="zb-h1"),
    # slice pairs whose forward collectives overlap the other slice's compute (--tensor-overlap)
    "terapipe-tp2-overlap": dict(stages=2, tensor=2, schedule="terapipe", slices=4, tensor_overlap=True),
}
BF16 = ("seq1f1b", "interleaved", "1f1b-tp2", "terapipe-tp2-overlap")
BF16_TOLERANCE = "5e-2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_of(plan: Path) -> int:
    """pipe x data (x tensor) processes the plan needs (its `mesh` line)."""
    m = re.search(r"^mesh pipe (\d+) data (\d+)(?: tensor (\d+))?", plan.read_text(), re.M)
    if not m:
        raise SystemExit(f"{plan}: no `mesh pipe P data D` line")
    return int(m.group(1)) * int(m.group(2)) * int(m.group(3) or 1)


def compile_all(out: Path, names) -> dict[str, Path]:
    from tpc.cli.main import main

    plans = {}
    for name in names:
        path = out / f"{name}.tpir"
        options = {**BASE, **PLANS[name]}
        argv = ["compile", options.pop("model", MODEL), "-o", str(path), "-q"]
        for key, value in options.items():
            flag = f"--{key.replace('_', '-')}"
            argv += [flag] if value is True else [flag, str(value)]
        if main(argv) != 0:
            raise SystemExit(f"tpc {' '.join(argv)} failed")
        plans[name] = path
    return plans


def launch(plan: Path, extra: list[str], device: str, gpus: int, log: Path, limit: float, nodes: bool,
           wait: float) -> tuple[int | None, str]:
    """Run the plan on its ranks; returns (exit status or None for a hang, combined output)."""
    run = ["-m", "tpc.cli.main", "run", str(plan), "--device", device, "--timeout", f"{wait:g}", *extra]
    return launch_ranks(ranks_of(plan), run, device, gpus, log, limit, nodes)


def launch_ranks(world: int, run: list[str], device: str, gpus: int, log: Path, limit: float,
                 nodes: bool) -> tuple[int | None, str]:
    """`torchrun ... RUN` on `world` ranks: one node of `world` processes, or where the GPUs are
    fewer than the ranks (or with `nodes`) one node per rank, each its own NCCL host."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not nodes and (device == "cpu" or gpus >= world):
        cmds = [([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                  "--max-restarts", "0", *run], env)]
    else:  # one node of one process per rank, each its own NCCL host
        cmds = [([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(world), "--nproc-per-node", "1",
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"gpu-{port}",
                  "--max-restarts", "0", *run],
                 dict(env, NCCL_HOSTID=f"tpc-host-{i}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1"))
                for i in range(world)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e) for c, e in cmds]
    outs, codes, start = [], [], time.monotonic()
    for p in procs:
        try:
            o, _ = p.communicate(timeout=max(1.0, limit - (time.monotonic() - start)))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            p.kill()
            o, _ = p.communicate()
            codes.append(None)
        outs.append(o)
    text = "\n".join(f"===== agent {i}\n{o}" for i, o in enumerate(outs))
    log.write_text(text)
    code = None if None in codes else max(codes)
    return code, text


def summary(text: str) -> str:
    """The verify-grads verdict and the last loss line of a run's output."""
    parts = []
    m = re.search(r"verify-grads: loss (\S+) vs autograd (\S+) .*?largest relative gradient error (\S+)", text)
    if m:
        parts.append(f"loss {m.group(1)} vs {m.group(2)}, grad error {m.group(3)}")
    steps = re.findall(r"(step \d+/\d+\s+loss\s+\S+)", text)
    return "; ".join(parts + steps[-1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda | cpu (default: cuda)")
    ap.add_argument("--out", default="gpu_checks", help="folder for plans and logs (default: gpu_checks)")
    ap.add_argument("--only", default="", help="comma-separated plan names (default: all of them)")
    ap.add_argument("--limit", type=float, default=240.0, help="seconds one run may take (default: 240)")
    ap.add_argument("--nodes", action="store_true",
                    help="one torchrun node per rank even where the GPUs (or the CPU) would do with one node")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="tpc run --timeout: seconds a rank waits for a peer (default: 60)")
    ap.add_argument("--tolerance", default="1e-5", help="--verify-grads tolerance in fp32 (default: 1e-5)")
    ap.add_argument("--parallel", type=int, default=4, help="runs at a time (default: 4)")
    ap.add_argument("--no-slicing", action="store_true", help="skip bench/gpu_slicing.py")
    ap.add_argument("--slicing-args", default="--repeats 3", help="arguments of bench/gpu_slicing.py")
    ap.add_argument("--no-score-transforms", action="store_true", help="skip bench/score_transforms.py")
    ap.add_argument("--no-ssm", action="store_true", help="skip bench/ssm_slicing.py")
    ap.add_argument("--score-args", default="",
                    help="further arguments of bench/score_transforms.py (default: none; on the CPU --quick)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="skip bench/tensor_overlap.py (a tensor group of 2, slice pairs against plain)")
    ap.add_argument("--overlap-args", default="--steps 4 --repeats 3", help="arguments of bench/tensor_overlap.py")
    ap.add_argument("--no-library", action="store_true",
                    help="skip the library's own training loop (examples/library_loop.py on 2 ranks)")
    ap.add_argument("--no-probe", action="store_true", help="skip bench/nccl_probe.py (plain torch's patterns)")
    ap.add_argument("--no-interpret", action="store_true",
                    help="skip the reference interpreter's run (it is one process, the same with or without --nodes)")
    args = ap.parse_args(argv)
    at_root()
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda":
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {torch.cuda.nccl.version()}, "
              f"{gpus} x {torch.cuda.get_device_name(0)}", flush=True)
    names = [n for n in args.only.split(",") if n] or list(PLANS)
    # plain torch first: can this backend and set-up run the patterns at all (bench/nccl_probe.py)
    if not args.no_probe:
        code, text = launch_ranks(2, ["bench/nccl_probe.py", "--device", args.device, "--deadline",
                                      f"{args.timeout:g}"], args.device, gpus, out / "nccl_probe.log", args.limit,
                                  args.nodes)
        probes = [ln.split(None, 1)[1] for ln in text.splitlines() if ln.startswith("nccl_probe ")]
        print("plain torch: " + ("; ".join(" ".join(p.split()) for p in probes) or f"no result (exit {code})"),
              flush=True)
    t0 = time.monotonic()
    plans = compile_all(out, names)
    print(f"compiled {len(plans)} plans in {time.monotonic() - t0:.0f} s", flush=True)

    fp32 = ["--verify-grads", "--steps", "2", "--tolerance", args.tolerance]
    jobs = [(n, "fp32", fp32) for n in names]
    if args.device == "cuda":
        jobs += [(n, "bf16", ["--verify-grads", "--steps", "2", "--bf16", "--tolerance", BF16_TOLERANCE])
                 for n in names if n in BF16]
    # the reference interpreter, every rank in one process, on the one device: the first plan
    first = names[0]
    interp = [] if args.no_interpret else [(first, "fp32", ["--tolerance", args.tolerance])]
    if args.device == "cuda" and not args.no_interpret:
        interp.append((first, "bf16", ["--bf16", "--tolerance", BF16_TOLERANCE]))

    def interpret(n: str, kind: str, extra: list[str]):
        cmd = [sys.executable, "-m", "tpc.cli.main", "run", "--interpret", str(plans[n]), "--device", args.device,
               "--verify-grads", "--steps", "2", *extra]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit)
        except subprocess.TimeoutExpired as e:
            (out / f"{n}-{kind}-interpret.log").write_text(str(e.stdout or "") + str(e.stderr or ""))
            return None, ""
        (out / f"{n}-{kind}-interpret.log").write_text(p.stdout + p.stderr)
        return p.returncode, p.stdout

    rows = []
    with cf.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futs = {pool.submit(interpret, n, kind, extra): (n + " --interpret", kind, "1 process")
                for n, kind, extra in interp}
        futs.update({pool.submit(launch, plans[n], extra, args.device, gpus, out / f"{n}-{kind}.log", args.limit,
                                 args.nodes, args.timeout): (n, kind, str(ranks_of(plans[n])))
                     for n, kind, extra in jobs})
        for f in cf.as_completed(futs):
            n, kind, ranks = futs[f]
            code, text = f.result()
            verdict = "ok" if code == 0 else ("HANG" if code is None else f"exit {code}")
            print(f"{n:22s} {kind}  {verdict:8s} {summary(text)}", flush=True)
            rows.append([n, kind, ranks, verdict, summary(text)])
    print()
    print(table(["plan", "dtype", "ranks", "result", "verify-grads; last step"], sorted(rows)))
    failed = [r for r in rows if r[3] != "ok"]
    if not args.no_library:  # a user's own loop (import tpc) on 2 ranks, NCCL on CUDA
        code, text = launch_ranks(2, ["examples/library_loop.py", "--device", args.device, "--steps", "6"],
                                  args.device, gpus, out / "library_loop.log", args.limit, args.nodes)
        last = [ln for ln in text.splitlines() if ln.startswith(("step ", "evaluation "))][-2:]
        print(f"\n# examples/library_loop.py (import tpc, 2 ranks): {'ok' if code == 0 else f'exit {code}'}; "
              + " | ".join(last), flush=True)
        failed += [["library_loop"]] if code != 0 else []
    if not args.no_overlap:  # one slice's tensor collectives under the next slice's compute
        # gpipe: the plain run eager, the paired one through the traced programs; zb-h1 (a split
        # backward): both through the programs, the pairs' effect alone
        for schedule in ("gpipe", "zb-h1"):
            code, text = launch_ranks(2, ["bench/tensor_overlap.py", "--device", args.device, "--schedule", schedule,
                                          *args.overlap_args.split()], args.device, gpus,
                                      out / f"tensor_overlap_{schedule}.log", args.limit, args.nodes)
            lines = [ln for ln in text.splitlines() if ln.startswith(("GPT ", "  plain", "  paired", "paired / plain"))]
            print(f"\n# bench/tensor_overlap.py --schedule {schedule} (2 ranks): "
                  + ("ok" if code == 0 else f"exit {code}"), flush=True)
            print("\n".join(lines), flush=True)
            failed += [["tensor_overlap " + schedule]] if code != 0 else []
    if not args.no_slicing:
        for extra in ([], ["--compile"]):  # eager, then every stage's programs compiled
            print("\n# bench/gpu_slicing.py " + " ".join([args.slicing_args, *extra]), flush=True)
            p = subprocess.run([sys.executable, "bench/gpu_slicing.py", *args.slicing_args.split(), *extra], text=True)
            failed += [["gpu_slicing" + (" --compile" if extra else "")]] if p.returncode else []
    if not args.no_ssm:  # state-space models sliced (their scans carried) against the model as written
        extra = ["--device", args.device] + (["--quick"] if args.device == "cpu" else [])
        print("\n# bench/ssm_slicing.py " + " ".join(extra), flush=True)
        p = subprocess.run([sys.executable, "bench/ssm_slicing.py", *extra], text=True)
        failed += [["ssm_slicing"]] if p.returncode else []
    if not args.no_score_transforms:  # soft-capping and sinks: written out vs FlexAttention
        for dtype in ("fp32", "bf16") if args.device == "cuda" else ("fp32",):
            extra = ["--device", args.device, "--dtype", dtype, *args.score_args.split()]
            extra += ["--quick"] if args.device == "cpu" and not args.score_args else []
            print("\n# bench/score_transforms.py " + " ".join(extra), flush=True)
            p = subprocess.run([sys.executable, "bench/score_transforms.py", *extra], text=True)
            failed += [["score_transforms " + dtype]] if p.returncode else []
    # the last line says which checks failed (the tables above are long)
    print("\nfailed: " + ", ".join(" ".join(map(str, r[:2])) for r in failed) if failed else "\nall checks passed",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
