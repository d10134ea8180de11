"""Checkpoints during a run: when to save, what each rank saves, and how a run resumes.

Both executors use this the same way (the interpreter with every rank's engine in one process,
the distributed executor with its one engine per process):

    ck = RunCheckpoints.from_options(plan, options)        # None without --checkpoint-dir
    start = ck.restore(engines) if ck and ck.resume else 0  # weights, optimizer, RNG, step
    for step in range(start, options.steps):
        ... run the step ...
        ck.after_step(engines, step + 1)                    # saves every N steps and at the end

A checkpoint at step N holds the state after N completed steps (steps 0 .. N-1), so a resumed
run continues with step N. Nothing else needs restoring: batches are drawn from (seed, step) and
the learning rate is a function of the step (`tpc.executors.training.lr`), so the step counter is the
data position and the schedule position. The plan is identified by the hash of its canonical
text (comments and layout do not count): a checkpoint of another plan or mesh is refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from tpc.executors.training import checkpoint
from tpc.ir.diagnostics import Diagnostic, TpirError


def plan_sha256(plan) -> str:
    """The hash of the plan's canonical text: the same plan, however formatted, hashes alike."""
    from tpc.ir.printer import print_plan

    return hashlib.sha256(print_plan(plan).encode("utf-8")).hexdigest()


def data_position(seed: int, next_step: int, source: str) -> dict:
    """What the data stream needs to continue: batches are a function of (seed, step)."""
    return {"seed": int(seed), "next_step": int(next_step), "source": source}


def engine_shard(engine, done: int, data: dict) -> dict:
    """One rank's shard: its stages' parameters by model name, its optimizer state, the number
    of completed steps, this process's RNG states and the data position."""
    return checkpoint.rank_shard(engine.named_parameters, engine.optimizer.opt, step=done, data=data)


@dataclass
class RunCheckpoints:
    """`--checkpoint-dir DIR --save-every N [--resume]` of one run ending at step `total`."""

    dir: Path
    every: int  # 0: only at the end of the run
    total: int
    resume: bool
    meta: dict  # tpc.json: checkpoint.run_meta (plan hash, mesh, model file, shapes)
    seed: int
    source: str  # where batches come from: the token file, or "random"
    say: Callable[[str], None] = field(default=lambda text: None)

    @staticmethod
    def from_options(plan, options, say: Callable[[str], None] | None = None) -> "RunCheckpoints | None":
        if not options.checkpoint_dir:
            return None
        return RunCheckpoints(
            dir=Path(options.checkpoint_dir), every=options.save_every, total=options.steps,
            resume=options.resume, meta=checkpoint.run_meta(plan.header, plan_sha256(plan)),
            seed=options.seed, source=str(Path(options.data).name) if options.data else "random",
            say=say or (lambda text: None))

    # ------------------------------------------------------------------------ saving

    def due(self, done: int) -> bool:
        """Save after every `every`-th step and after the last one."""
        return done >= self.total or (self.every > 0 and done % self.every == 0)

    def after_step(self, engines: Sequence, done: int, *, process_group=None) -> Path | None:
        """Save when `done` steps make a checkpoint due. Every process of a distributed run calls
        this with its own engine (all write in parallel); the interpreter with all of them."""
        if not self.due(done):
            return None
        data = data_position(self.seed, done, self.source)
        shards = {checkpoint.shard_key(e.global_rank): engine_shard(e, done, data) for e in engines}
        path = checkpoint.save_checkpoint(self.dir, done, shards, self.meta, process_group=process_group)
        self.say(f"checkpoint: {path} (step {done})")
        return path

    # ---------------------------------------------------------------------- resuming

    def restore(self, engines: Sequence, *, process_group=None) -> int:
        """Load the newest complete checkpoint into `engines` (in place) and this process's RNG;
        returns its step, where the run continues. Refused: no checkpoint, one of another plan
        or mesh, another --seed or data source, or one already past --steps."""
        found = checkpoint.latest_checkpoint(self.dir)
        if found is None:
            raise TpirError(Diagnostic(
                f"--resume: no complete checkpoint in {self.dir}", where="--resume",
                hint="start without --resume (the run saves into --checkpoint-dir), or point "
                     "--checkpoint-dir at the directory an earlier run wrote"))
        meta = checkpoint.read_meta(found)
        checkpoint.check_meta(meta, checkpoint.resume_expect(self.meta), found)
        step = meta["step"]
        if step > self.total:
            raise TpirError(Diagnostic(
                f"--resume: the checkpoint {found} is at step {step}, past --steps {self.total}",
                where="--steps",
                hint=f"--steps is the step the run ends at: give --steps {step + 1} or more to train on"))
        for e in engines:
            if e.optimizer.opt is not None:
                checkpoint.init_optimizer_state(e.optimizer.opt)  # tensors for the load to fill
        template = {checkpoint.shard_key(e.global_rank): engine_shard(e, 0, data_position(0, 0, ""))
                    for e in engines}
        checkpoint.load_checkpoint(found, template, expect=checkpoint.resume_expect(self.meta),
                                   process_group=process_group)
        first = template[checkpoint.shard_key(engines[0].global_rank)]
        data = first["data"]
        if data["seed"] != self.seed or data["source"] != self.source:
            raise TpirError(Diagnostic(
                f"--resume: the checkpoint {found} was trained on data {data['source']!r} with --seed "
                f"{data['seed']}, this run asks for {self.source!r} with --seed {self.seed}",
                where="--resume",
                hint="resume with the same --data and --seed, so the batches continue where they stopped"))
        for shard in template.values():
            if shard["step"] != step:
                raise TpirError(Diagnostic(
                    f"{found}: corrupt checkpoint: its shards disagree on the step ({shard['step']} and {step})",
                    hint="resume from an earlier step directory, or delete this one"))
        checkpoint.restore_rng(first)
        self.say(f"resumed from {found} (step {step})" +
                 (f"; it already reaches --steps {self.total}, nothing to train" if step == self.total else ""))
        return step
