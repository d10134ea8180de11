"""Running nanoGPT's own train.py (examples/nanogpt_train/train.py, as nanoGPT ships it) and its
tpc-pipelined copy (train_tpc.py) on a tiny corpus, for the library's tests."""

from __future__ import annotations

import math
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from tests.executors.dist_harness import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nanogpt_train"
VOCAB = 61


def workdir(tmp_path: Path) -> Path:
    """nanoGPT's folder (model.py, configurator.py, both train scripts) with a corpus in
    data/tiny (uint16 tokens and meta.pkl's vocab_size, as nanoGPT's prepare scripts write)."""
    work = tmp_path / "nanogpt"
    shutil.copytree(EXAMPLE, work)
    data = work / "data" / "tiny"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 1000)):
        rng.integers(0, VOCAB, n, dtype=np.uint16).tofile(data / f"{split}.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": VOCAB}, f)
    return work


def config(*, max_iters: int, accumulation: int, eval_iters: int, slices: int = 1) -> list[str]:
    """nanoGPT's --key=value overrides: a 4-layer model on the CPU in float32, AdamW with its
    cosine schedule and clipping, evaluated and saved at the last iteration."""
    return ["--dataset=tiny", "--device=cpu", "--compile=False", "--dtype=float32", "--n_layer=4", "--n_head=2",
            "--n_embd=32", "--block_size=16", "--batch_size=4", f"--gradient_accumulation_steps={accumulation}",
            f"--max_iters={max_iters}", f"--eval_interval={max_iters}", f"--eval_iters={eval_iters}",
            "--warmup_iters=2", f"--lr_decay_iters={max_iters}", "--learning_rate=0.01", "--min_lr=0.001",
            "--grad_clip=0.5", "--bias=True", "--out_dir=out"] + ([f"--slices={slices}"] if slices != 1 else [])


def run(work: Path, script: str, args: list[str], ranks: int = 0) -> str:
    """`python SCRIPT ARGS` in `work` (ranks=0), or under torchrun with `ranks` processes; stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", str(free_port()), "--local-ranks-filter", "0", script, *args]
    else:
        cmd = [sys.executable, script, *args]
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return done.stdout


def losses(stdout: str) -> list[float]:
    """The losses of nanoGPT's `iter N: loss X` lines, by N (torchrun's ranks share one stdout,
    so a line need not start where a line of another rank's ended)."""
    found = {int(n): float(x) for n, x in re.findall(r"iter (\d+): loss ([0-9.]+)", stdout)}
    return [found[n] for n in sorted(found)]


def checkpoint(work: Path, ranks: int = 0) -> tuple[dict[str, torch.Tensor], float]:
    """The saved model (every rank's part together) and the validation loss saved with it."""
    if not ranks:
        ck = torch.load(work / "out" / "ckpt.pt", weights_only=False)
        return ck["model"], float(ck["best_val_loss"])
    parts = [torch.load(work / "out" / f"ckpt{r}.pt", weights_only=False) for r in range(ranks)]
    model: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, value in part["model"].items():
            if name in model:  # a tied weight is on both ranks, the same after every step
                assert torch.equal(model[name], value), name
            model[name] = value
    vals = [float(p["best_val_loss"]) for p in parts]
    # every rank has the same validation loss (nan without evaluation batches: eval_iters=0)
    assert all(v == vals[0] or (math.isnan(v) and math.isnan(vals[0])) for v in vals), vals
    return model, vals[0]
