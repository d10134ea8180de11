"""Models larger than a host (docs/benchmarks.md, "Large models"): what `tpc compile` and each
rank of `tpc run` hold, for Hugging Face Llama configurations written here (nothing is
downloaded; the weights are random).

    python bench/large_models.py compile 7b      # Llama-2-7B at L=4096: wall time, peak RSS
    python bench/large_models.py compile 70b     # Llama-3-70B at L=4096
    python bench/large_models.py run             # a ~1B Llama, 4 pipeline ranks under torchrun
                                                 # on the CPU, 1 step: each rank's peak RSS
                                                 # against 1.2 x (params + grads + AdamW) + 300 MB

Each command runs in a fresh process whose peak RSS (`getrusage`) is what is printed; run one at
a time (a 2-core, 24 GB machine).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    # meta-llama/Llama-2-7b-hf
    "7b": dict(LLAMA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    # meta-llama/Meta-Llama-3-70B
    "70b": dict(LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # ~1B: TinyLlama's shapes with 20 layers
    "1b": dict(LLAMA, hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
}
STAGES = {"7b": 8, "70b": 16}
MB = 1 << 20


def write_config(folder: Path, name: str) -> str:
    path = folder / f"llama_{name}.json"
    path.write_text(json.dumps(CONFIGS[name], indent=1))
    return str(path)


def child_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def compile_bench(name: str) -> None:
    folder = Path(tempfile.mkdtemp())
    config = write_config(folder, name)
    cmd = ["tpc", "compile", config, "-o", str(folder / "plan.tpir"), "--stages", str(STAGES[name]),
           "--seq-len", "4096", "--batch", "8", "--slices", "4"]
    print("$", " ".join(cmd), flush=True)
    t = time.perf_counter()
    done = subprocess.run(cmd, text=True, capture_output=True)
    wall = time.perf_counter() - t
    passes = [ln for ln in done.stderr.splitlines() if ln.startswith("  ") and "s  " in ln]
    print("\n".join(passes))
    if done.returncode != 0:
        print(done.stderr[-3000:])
    params = sum(_params(CONFIGS[name]))
    print(f"{name}: {params / 1e9:.2f}B parameters ({params * 4 / 2**30:.1f} GiB in fp32); compile wall "
          f"{wall:.1f} s, peak RSS {child_peak_mb():.0f} MB, exit {done.returncode}")


def _params(c: dict):
    h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    yield v * h * (1 if c.get("tie_word_embeddings") else 2)
    yield n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)
    yield h


def run_bench() -> None:
    folder = Path(tempfile.mkdtemp())
    config = write_config(folder, "1b")
    plan = folder / "plan.tpir"
    cmd = ["tpc", "compile", config, "-o", str(plan), "--stages", "4", "--seq-len", "128", "--batch", "2",
           "--slices", "2", "-q"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", __file__, "rank", str(plan)]
    print("$", " ".join(cmd[2:]), flush=True)
    t = time.perf_counter()
    done = subprocess.run(cmd, text=True, capture_output=True, env=env)
    print(done.stdout[-4000:], done.stderr[-2000:] if done.returncode else "")
    print(f"torchrun wall {time.perf_counter() - t:.1f} s, exit {done.returncode}")


def rank_main(plan: str) -> int:
    """One rank: `tpc run PLAN --steps 1`, then its peak RSS against what its stages hold."""
    from tpc.cli.main import main
    from tpc.executors.plan_model import load_plan_model, rank_parameter_names, slice_model
    from tpc.executors.pipeline import PlanSet
    from tpc.ir.parse import parse

    status = main(["run", plan, "--steps", "1", "--optimizer", "adamw", "--timeout", "600"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rank = int(os.environ["RANK"])
    p = parse(Path(plan).read_text(), file=plan)
    model = load_plan_model(p, 0, weights=False)
    sliced = slice_model(model, p)
    params = dict(model.named_parameters())
    held = sum(params[n].numel() for n in rank_parameter_names(PlanSet.single(p), {p.header.shape.seq: sliced},
                                                                p.header.mesh.value.pipe_rank(rank)))
    state = held * 16 / MB  # fp32 weight + gradient + AdamW's two moments
    bound = 1.2 * state + 300
    print(f"rank {rank}: {held / 1e6:.0f}M parameters, params+grads+AdamW {state:.0f} MB, peak RSS {peak:.0f} MB, "
          f"bound 1.2 x state + 300 MB = {bound:.0f} MB: {'ok' if peak <= bound else 'OVER'}", flush=True)
    return status


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "compile"
    if what == "compile":
        compile_bench(sys.argv[2] if len(sys.argv) > 2 else "7b")
    elif what == "run":
        run_bench()
    elif what == "rank":
        sys.exit(rank_main(sys.argv[2]))
    else:
        sys.exit(f"unknown command {what}: compile 7b|70b, run")
