"""Where a run's weights come from and where they go: saving checkpoints, resuming from one
(under the same plan or any other plan of the same model), or starting from --init-from weights.

Both executors use this the same way (the interpreter with every rank's engine in one process,
the distributed executor with its one engine per process):

    ck = RunCheckpoints.from_options(plan, options, model=model)   # None: nothing to load or save
    start = ck.start(engines) if ck else 0                  # resume, or --init-from, or step 0
    for step in range(start, options.steps):
        ... run the step ...
        ck.after_step(engines, step + 1)                    # saves every N steps and at the end

A checkpoint at step N holds the state after N completed steps (steps 0 .. N-1), so a resumed
run continues with step N. Nothing else needs restoring: batches are drawn from (seed, step) and
the learning rate is a function of the step (`tpc.executors.training.lr`), so the step counter is
the data position and the schedule position.

A checkpoint is keyed by the unsliced model's parameter names (`model_state.py`), so a run may
resume under another plan of the same model: other slices, micro-batches, schedule, stage split,
pipeline depth or data-parallel degree. What must match is checked before anything is read and
refused with a located message: the model (its file's hash and factory, at the plan's model
line), the optimizer kind (its state), the data (--data and --seed). What differs is said in one
line ("resuming step 10 of DIR/step_000010 from a 2x1 mesh on a 4x1 mesh (pipe x data); ...").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch.distributed as dist

from tpc.executors.training import checkpoint
from tpc.executors.training.dir_lock import DirLock
from tpc.executors.training.model_state import Layout, load_state, state_to_save
from tpc.ir.diagnostics import Diagnostic, TpirError


def plan_sha256(plan) -> str:
    """The hash of the plan's canonical text: the same plan, however formatted, hashes alike."""
    from tpc.ir.printer import print_plan

    return hashlib.sha256(print_plan(plan).encode("utf-8")).hexdigest()


def data_position(seed: int, next_step: int, source: str, curriculum: dict | None = None) -> dict:
    """What the data stream needs to continue: batches are a function of (seed, step), and
    under a sequence-length curriculum (executors/curriculum.py) of the curriculum too, whose
    spelling, data type and next step's length are recorded with them."""
    out = {"seed": int(seed), "next_step": int(next_step), "source": source}
    if curriculum is not None:
        out.update(curriculum=curriculum["spec"], curriculum_type=curriculum["type"],
                   seq=int(curriculum["length_of"](next_step)))
    return out


@dataclass
class RunCheckpoints:
    """`--checkpoint-dir DIR --save-every N [--resume]` and `--init-from PATH` of one run ending
    at step `total`."""

    dir: Path | None  # None: nothing is saved (a run with --init-from only)
    every: int  # 0: only at the end of the run
    total: int
    resume: bool
    meta: dict  # tpc.json: checkpoint.run_meta (model, optimizer, plan hash, mesh, plan summary)
    seed: int
    source: str  # where batches come from: the token file, or "random"
    plan: object = None  # the plan (its model line locates a refusal)
    init_from: str | None = None
    model_names: object = None  # init_from.ModelNames of the unsliced model, for --init-from
    say: Callable[[str], None] = field(default=lambda text: None)
    save_best: bool = False  # keep DIR/best, the checkpoint of the lowest validation loss
    best: float = float("inf")  # its validation loss (read back from DIR/best when resuming)
    # a sequence-length curriculum: {"spec", "type", "length_of": step -> length}; None: none
    curriculum: dict | None = None
    dir_lock: DirLock | None = None  # held from `lock()` to `unlock()` (by global rank 0 under torchrun)

    @staticmethod
    def from_options(plan, options, say: Callable[[str], None] | None = None,
                     model=None, curriculum: dict | None = None) -> "RunCheckpoints | None":
        """None when the run neither saves nor loads anything. `model` is the unsliced model
        (needed with --init-from: the file's names are checked against all of its names);
        `curriculum` is recorded with the data position (see `data_position`)."""
        if not options.checkpoint_dir and not options.init_from:
            return None
        names = None
        if options.init_from:
            from tpc.executors.training.init_from import ModelNames

            if model is None:
                raise ValueError("--init-from needs the unsliced model to check the file's names against")
            names = ModelNames.of(model)
        return RunCheckpoints(
            dir=Path(options.checkpoint_dir) if options.checkpoint_dir else None, every=options.save_every,
            total=options.steps, resume=options.resume,
            meta=checkpoint.run_meta(plan.header, plan_sha256(plan), options.optim.kind),
            seed=options.seed, source=str(Path(options.data).name) if options.data else "random",
            plan=plan, init_from=options.init_from, model_names=names, say=say or (lambda text: None),
            save_best=options.save_best, curriculum=curriculum)

    # ------------------------------------------------------------------------- the lock

    def lock(self, *, process_group=None) -> None:
        """Lock DIR for this run before anything is loaded or saved (dir_lock.py): a second run on
        it is refused, naming the first. Under torchrun global rank 0 takes the lock and every
        process learns the outcome, so all go on or all refuse alike. A no-op without DIR."""
        if self.dir is None:
            return
        distributed = checkpoint.is_distributed(process_group)
        problems = None
        if not distributed or dist.get_rank() == 0:
            held = DirLock(self.dir)  # a stale lock taken over is said on stderr, even with -q
            try:
                held.acquire()
                self.dir_lock = held
            except TpirError as e:
                problems = e.diagnostics
        if distributed:
            box = [problems]
            dist.broadcast_object_list(box, src=0, group=process_group)
            problems = box[0]
        if problems:
            raise TpirError(problems)

    def unlock(self) -> None:
        """Release DIR's lock (every way out of a run ends here); a no-op when not held."""
        held, self.dir_lock = self.dir_lock, None
        if held is not None:
            held.release()

    # ------------------------------------------------------------------------ starting

    def start(self, engines: Sequence, *, process_group=None) -> int:
        """Load what the run starts from into `engines` and return the step it starts at: the
        newest checkpoint with --resume (when DIR has one, or always without --init-from), else
        the --init-from weights at step 0, else nothing (step 0)."""
        if self.resume and self.save_best:
            best = self.dir / checkpoint.BEST
            if checkpoint.is_complete(best):
                self.best = float(checkpoint.read_meta(best).get("val_loss", float("inf")))
        if self.resume:
            found = checkpoint.latest_checkpoint(self.dir)
            if found is not None or not self.init_from:
                return self.restore(engines, process_group=process_group)
            self.say(f"--resume: no checkpoint in {self.dir} yet, starting from --init-from {self.init_from}")
        if self.init_from:
            from tpc.executors.training.init_from import config_differences, init_engines

            weights = init_engines(engines, self.init_from, self.model_names)
            self.say(f"initialised from {weights.path} ({weights.what})")
            differ = config_differences(self.model_names, weights)
            if differ:
                self.say(f"note: its config.json differs from the model's: {'; '.join(differ)}")
        return 0

    # ------------------------------------------------------------------------ saving

    def due(self, done: int) -> bool:
        """Save after every `every`-th step and after the last one."""
        return self.dir is not None and (done >= self.total or (self.every > 0 and done % self.every == 0))

    def after_step(self, engines: Sequence, done: int, *, process_group=None) -> Path | None:
        """Save when `done` steps make a checkpoint due. Every process of a distributed run calls
        this with its own engine (all write in parallel); the interpreter with all of them."""
        if not self.due(done):
            return None
        state = state_to_save(engines, done, data_position(self.seed, done, self.source, self.curriculum))
        path = checkpoint.save_checkpoint(self.dir, done, state, self.meta, process_group=process_group)
        self.say(f"checkpoint: {path} (step {done})")
        return path

    def after_eval(self, engines: Sequence, done: int, val_loss: float, *, process_group=None) -> Path | None:
        """With --save-best, save DIR/best when the validation loss after `done` steps is the
        lowest so far. Every process calls this with the same loss (all write, or none)."""
        if not self.save_best or self.dir is None or not val_loss < self.best:
            return None
        state = state_to_save(engines, done, data_position(self.seed, done, self.source))
        path = checkpoint.save_checkpoint(self.dir, done, state, {**self.meta, "val_loss": val_loss},
                                          process_group=process_group, name=checkpoint.BEST)
        self.best = val_loss
        self.say(f"best checkpoint: {path} (step {done}, validation loss {val_loss:.4f})")
        return path

    # ---------------------------------------------------------------------- resuming

    def restore(self, engines: Sequence, *, process_group=None) -> int:
        """Load the newest complete checkpoint into `engines` (in place) and this process's RNG;
        returns its step, where the run continues. Refused: no checkpoint, one of another model
        or optimizer, another --seed or data source, or one already past --steps."""
        found = checkpoint.latest_checkpoint(self.dir)
        if found is None:
            raise TpirError(Diagnostic(
                f"--resume: no complete checkpoint in {self.dir}", where="--resume",
                hint="start without --resume (the run saves into --checkpoint-dir), or point "
                     "--checkpoint-dir at the directory an earlier run wrote"))
        meta = checkpoint.read_meta(found)
        self._check_model(meta, found)
        layout = Layout(found, meta, checkpoint.stored_entries(found))
        kind = meta.get("optimizer") or layout.optimizer
        if kind != self.meta["optimizer"]:
            raise TpirError(Diagnostic(
                f"--resume: {found} holds the state of {kind}, this run asks for --optimizer {self.meta['optimizer']}",
                where="--optimizer", hint=f"resume with --optimizer {kind}, or start from its weights alone "
                                          f"with --init-from {found} and another --checkpoint-dir"))
        step = meta["step"]
        if step > self.total:
            raise TpirError(Diagnostic(
                f"--resume: the checkpoint {found} is at step {step}, past --steps {self.total}",
                where="--steps",
                hint=f"--steps is the step the run ends at: give --steps {step + 1} or more to train on"))
        loaded = load_state(found, layout, engines, process_group=process_group)
        data = loaded.data
        if data.get("seed") != self.seed or data.get("source") != self.source:
            raise TpirError(Diagnostic(
                f"--resume: the checkpoint {found} was trained on data {data.get('source')!r} with --seed "
                f"{data.get('seed')}, this run asks for {self.source!r} with --seed {self.seed}",
                where="--resume",
                hint="resume with the same --data and --seed, so the batches continue where they stopped"))
        theirs = (data.get("curriculum"), data.get("curriculum_type"))
        mine = (self.curriculum["spec"], self.curriculum["type"]) if self.curriculum else (None, None)
        if theirs != mine:
            def say(c):
                return f"--curriculum {c[0]} --curriculum-type {c[1]}" if c[0] else "no curriculum"
            raise TpirError(Diagnostic(
                f"--resume: the checkpoint {found} was trained with {say(theirs)}, this run asks for "
                f"{say(mine)}", where="--curriculum",
                hint="resume with the same curriculum, so each step gets the length and batch it had; "
                     f"to start from its weights alone use --init-from {found} with another --checkpoint-dir"))
        if self.curriculum and data.get("seq") is not None and int(data["seq"]) != self.curriculum["length_of"](step):
            raise TpirError(Diagnostic(
                f"--resume: the checkpoint {found} would continue at length {data['seq']}, and this "
                f"bundle gives step {step + 1} length {self.curriculum['length_of'](step)}",
                where="--curriculum",
                hint="the bundle's lengths changed: resume with the bundle the run was started with"))
        if loaded.step != step:
            raise TpirError(Diagnostic(
                f"{found}: corrupt checkpoint: its shards are at step {loaded.step}, tpc.json says {step}",
                hint="resume from an earlier step directory, or delete this one"))
        if loaded.rng is not None:
            checkpoint.restore_rng(loaded.rng)
        if not checkpoint.is_verified(meta):
            self.say(f"note: {found} records no checksums (written by an earlier tpc): its files "
                     "were loaded without verifying them")
        at = (f" at length {data.get('seq')} of --curriculum {self.curriculum['spec']}"
              if self.curriculum and data.get("seq") is not None else "")
        self.say(describe_resume(meta, self.meta, found, step) + at +
                 (f"; it already reaches --steps {self.total}, nothing to train" if step == self.total else ""))
        return step

    def _check_model(self, meta: dict, found: Path) -> None:
        """The checkpoint must hold this plan's model: the same model file (by content) and factory."""
        mine = self.meta
        if meta.get("sha256") == mine["sha256"] and meta.get("factory") == mine["factory"]:
            return
        line = self.plan.header.model if self.plan is not None else None
        theirs = f"{meta.get('model_path')} (factory {meta.get('factory')}, sha256 {str(meta.get('sha256'))[:12]}...)"
        ours = f"{mine['model_path']} (factory {mine['factory']}, sha256 {mine['sha256'][:12]}...)"
        raise TpirError(Diagnostic(
            f"--resume: {found} was written by a run of another model: {theirs}; this plan's model is {ours}",
            loc=line.loc if line is not None else None, where=self.plan.source if self.plan is not None else None,
            hint=f"resume with a plan compiled from the model that wrote it; to start this model from its "
                 f"weights (names and shapes must match), use --init-from {found} with another --checkpoint-dir"))


def describe_resume(meta: dict, now: dict, found: Path, step: int) -> str:
    """One line: where the run resumes, and what differs between the plan that wrote the
    checkpoint and this one."""
    if meta.get("plan_sha256") == now["plan_sha256"]:
        return f"resumed from {found} (step {step})"
    mesh = meta.get("mesh") or {}
    old = dict(meta.get("plan") or {"mesh": f"{mesh.get('pipe')}x{mesh.get('data')}"})
    new = now["plan"]
    # "2x1", or "2x1x2" with a tensor axis
    axes = "(pipe x data x tensor)" if max(old["mesh"].count("x"), new["mesh"].count("x")) == 2 else "(pipe x data)"
    if old["mesh"] != new["mesh"]:
        where = f"from a {old['mesh']} mesh on a {new['mesh']} mesh {axes}"
    else:
        where = f"on the same {new['mesh']} mesh {axes}"
    changes = [f"{k} {old[k]} -> {new[k]}" for k in new if k != "mesh" and k in old and old[k] != new[k]]
    if "plan" not in meta:
        changes.append("another plan (this checkpoint, of format 1, does not describe its plan)")
    return f"resuming step {step} of {found} {where}" + "".join(f"; {c}" for c in changes)
