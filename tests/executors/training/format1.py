"""Checkpoints of format 1, as `tpc run` wrote them before they were keyed by the unsliced model's
names: one shard per rank under "rank<global rank>" (its parameters by name, their optimizer
state, the step, its RNG and the data position), and a tpc.json without the plan summary and the
optimizer kind. The code below is that version's writer (checkpoint.rank_shard, run_meta and
RunCheckpoints.after_step), kept to check that such checkpoints are still read."""

from __future__ import annotations

import os
from pathlib import Path

from tpc.executors.training import checkpoint
from tpc.executors.training.run_checkpoints import data_position, plan_sha256
from tpc.executors.training_loop import CheckpointHook


def rank_shard(named_params, optimizer, *, step, data):
    seen, params = set(), []
    for name, p in named_params:
        if id(p) not in seen:
            seen.add(id(p))
            params.append((name, p))
    shard = {"params": {name: p.detach() for name, p in params}, "step": int(step),
             "rng": checkpoint.rng_state(), "data": dict(data)}
    if optimizer is not None:
        shard["optim"] = checkpoint.optimizer_state(optimizer, params)
    return shard


def run_meta(header, sha: str) -> dict:
    return {"format": 1, "plan_sha256": sha, "mesh": {"pipe": header.mesh.pipe, "data": header.mesh.data},
            "model_path": os.path.abspath(header.model.path), "factory": header.model.factory,
            "sha256": header.model.sha256, "seq": header.shape.seq, "vocab": header.shape.vocab}


class Format1Saver(CheckpointHook):
    """Stands in for RunCheckpoints in `interpret`: starts from step 0 and saves at the last step
    in format 1."""

    def __init__(self, plan, directory: Path, total: int, seed: int = 0, source: str = "random"):
        self.dir, self.total, self.seed, self.source = directory, total, seed, source
        self.meta = run_meta(plan.header, plan_sha256(plan))

    # (no lock: the tests using it write into their own folders)

    def after_step(self, engines, done: int):
        if done != self.total:
            return None
        data = data_position(self.seed, done, self.source)
        shards = {f"rank{e.global_rank}": rank_shard(e.named_parameters, e.optimizer.opt, step=done, data=data)
                  for e in engines}
        return checkpoint.save_checkpoint(self.dir, done, shards, self.meta)
