"""Shared pieces of the end-to-end training tests: one plan of the tiny example GPT, a token file,
the `tpc run` options they train with, and the oracle: plain single-process PyTorch training of
the unsliced model, written out here (optimizer groups, schedule, clipping) rather than taken
from the modules under test."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tests.executors.real import model_file, real_plan
from tpc.executors.training.token_file import TokenFileBatches
from tpc.ir.printer import print_plan

SEQ, BATCH, SEED = 16, 4, 0
LR, WD, BETAS, WARMUP, CLIP = 3e-3, 0.1, (0.9, 0.95), 5, 0.5
# pp=2, 2 micro-batches of 2 rows, 3 token slices of unequal lengths, seq1f1b
PLAN = dict(stages=2, microbatches=2, slices="5,4,7", schedule="seq1f1b", seq_len=SEQ, batch=BATCH)
TRAIN = ["--optimizer", "adamw", "--lr", str(LR), "--weight-decay", str(WD), "--warmup", str(WARMUP),
         "--grad-clip", str(CLIP), "--seed", str(SEED), "--device", "cpu"]


def write_plan(directory: Path) -> str:
    out = directory / "plan.tpir"
    out.write_text(print_plan(real_plan("gpt", **PLAN)), encoding="utf-8")
    return str(out)


def write_tokens(directory: Path) -> str:
    """Byte tokens of real text (this project's model file, repeated) as uint16, nanoGPT's format."""
    text = Path(model_file("gpt")).resolve().parents[3].joinpath("examples", "gpt.py").read_bytes() * 4
    path = directory / "train.bin"
    np.frombuffer(text, dtype=np.uint8).astype(np.uint16).tofile(path)
    return str(path)


def batches(data: str) -> TokenFileBatches:
    return TokenFileBatches(data, seed=SEED, batch=BATCH, seq=SEQ, vocab=256)


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def schedule(step: int, total: int) -> float:
    """Linear warm-up to LR over WARMUP steps, then half a cosine down to LR / 10 at `total`."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / (total - WARMUP)
    return LR / 10 + (LR - LR / 10) * 0.5 * (1 + math.cos(math.pi * progress))


def initial_model() -> torch.nn.Module:
    """The tiny GPT with the weights `tpc run --seed 0` starts from: the file's model() after
    torch.manual_seed(0)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tests_training_oracle_gpt", model_file("gpt"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    torch.manual_seed(SEED)
    return module.model()


def plain_training(data: str, steps: int, total: int) -> tuple[list[float], torch.nn.Module]:
    """Losses of `steps` steps of ordinary training on the unsliced model, on the run's batches:
    AdamW with decay on matrices only, the schedule above ending at `total`, global-norm clipping."""
    model = initial_model()
    params = sorted({id(p): (n, p) for n, p in model.named_parameters()}.values(), key=lambda t: t[0])
    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, foreach=False)
    source = batches(data)
    losses = []
    for step in range(steps):
        tokens = source.get(step)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], CLIP)
        for group in opt.param_groups:
            group["lr"] = schedule(step, total)
        opt.step()
        losses.append(loss.item())
    return losses, model


def run_cli_rank(rank: int, out_dir: str, argv: list[str], stop_after_save: int | None = None) -> None:
    """A torchrun rank (under tests.executors.dist_harness.launch): `tpc run ARGV`, leaving with its
    exit status. `stop_after_save=N` interrupts the run right after checkpoint N is saved, as a
    Ctrl-C there would."""
    from tpc.cli.main import main

    if stop_after_save is not None:
        interrupt_after_save(stop_after_save)
    sys.stderr.flush()
    sys.exit(main(argv))


def interrupt_after_save(step: int) -> None:
    """Make the run raise KeyboardInterrupt just after it saved checkpoint `step`."""
    from tpc.executors.training import checkpoint

    checkpoint.save_checkpoint = stopping_after(step)


def stopping_after(step: int):
    """checkpoint.save_checkpoint, then KeyboardInterrupt once checkpoint `step` is saved."""
    from tpc.executors.training import checkpoint

    real = checkpoint.save_checkpoint

    def save_then_stop(dir, done, shards, meta, **kw):
        path = real(dir, done, shards, meta, **kw)
        if done == step:
            raise KeyboardInterrupt
        return path

    return save_then_stop
