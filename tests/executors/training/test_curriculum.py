"""A sequence-length curriculum over a plan bundle trains exactly as plain PyTorch does.

The oracle is written out here, independently of executors/curriculum.py: single-process
training of the unsliced tiny GPT whose lengths come from a transcription of DeepSpeed's own
stateful `CurriculumScheduler.update_difficulty` (called with global_steps + 1 before each step,
as DeepSpeed's engine does), whose batches are the run's token-file batches at the full length
cut as Megatron-DeepSpeed cuts them (`tokens[:, :L]` for seqlen_truncate, `reshape(-1, L)` of
ids and labels for seqlen_reshape), with AdamW on decay groups, warm-up + cosine and clipping.
Every step's loss is held to 1e-4 across the plan switches, in the interpreter and in two gloo
processes (pp=2); a run stopped in the middle of the curriculum and resumed is the run never
stopped; and what cannot work is refused before any communication, located.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.executors.dist_harness import launch
from tests.executors.real import model_file
from tests.executors.training.run_helpers import (BETAS, CLIP, LR, SEED, TRAIN, WD, initial_model, metrics,
                                                  run_cli_rank, schedule, stopping_after, write_tokens)
from tpc.cli.main import main
from tpc.executors.curriculum import parse_curriculum, shape_batch
from tpc.executors.training import checkpoint
from tpc.executors.training.token_file import TokenFileBatches

TOL = 1e-4
LENGTHS = (8, 16, 32)
BATCH = 4
# DeepSpeed's lengths 8,8,16,16,16,16(24->16),16(24->16),32,...: two plan switches
LINEAR = "fixed_linear:8:32:8"
# 8 for steps 1-3, 16 for 4-6, then 32
DISCRETE = "fixed_discrete:8,16,32:3,6"


@pytest.fixture(autouse=True)
def no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _compile(folder: Path, *extra: str) -> str:
    assert main(["compile", model_file("gpt"), "-o", str(folder), "--seq-len", ",".join(map(str, LENGTHS)),
                 "--batch", str(BATCH), "--stages", "2", "--microbatches", "2", "--slices", "2", "-q",
                 *extra]) == 0
    return str(folder)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("curriculum")
    return _compile(d / "plans"), _compile(d / "reshape", "--constant-tokens"), write_tokens(d)


# ------------------------------------------------------------------------------ the oracle


class DeepSpeedScheduler:
    """DeepSpeed's CurriculumScheduler (data_pipeline/curriculum_scheduler.py), transcribed."""

    def __init__(self, kind, min_d, max_d, total_step=None, difficulty_step=8, root_degree=None,
                 difficulty=None, max_step=None):
        self.kind, self.min, self.max = kind, min_d, max_d
        self.total, self.dstep, self.degree = total_step, difficulty_step, root_degree
        self.difficulty, self.max_step = difficulty, max_step
        self.current = min_d

    def get_difficulty(self, g):
        if self.kind == "fixed_discrete":
            if g > self.max_step[-1]:
                return self.difficulty[-1]
            for i in range(len(self.max_step)):
                if g <= self.max_step[i]:
                    return self.difficulty[i]
        degree = 1 if self.kind == "fixed_linear" else self.degree
        d = (float(g) / self.total) ** (1.0 / degree)
        d = math.floor(d * (self.max - self.min) + self.min)
        d -= d % self.dstep
        return min(d, self.max)

    def update_difficulty(self, g):
        if self.current < self.max:
            self.current = self.get_difficulty(g)
        return self.current


def scheduler(spec: str) -> DeepSpeedScheduler:
    kind, *rest = spec.split(":")
    if kind == "fixed_discrete":
        ds, ss = [int(v) for v in rest[0].split(",")], [int(v) for v in rest[1].split(",")]
        return DeepSpeedScheduler(kind, ds[0], max(ds), difficulty=ds, max_step=ss)
    start, end, total = (int(v) for v in rest[:3])
    return DeepSpeedScheduler(kind, start, end, total_step=total,
                              root_degree=int(rest[3]) if len(rest) > 3 else 2)


def plain_curriculum(data: str, spec: str, steps: int, reshape: bool = False) -> tuple[list[float], list[int]]:
    """Losses and lengths of plain training with DeepSpeed's curriculum (module docstring)."""
    model = initial_model()
    params = sorted({id(p): (n, p) for n, p in model.named_parameters()}.values(), key=lambda t: t[0])
    opt = torch.optim.AdamW([{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, foreach=False)
    sched = scheduler(spec)
    full = TokenFileBatches(data, seed=SEED, batch=BATCH, seq=sched.max, vocab=256)
    losses, lengths = [], []
    for step in range(steps):
        d = sched.update_difficulty(step + 1)
        seq = max(l for l in LENGTHS if l <= d)  # rounded down to the bundle's lengths
        tokens = full.get(step)
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        if reshape:
            ids, labels = ids.reshape(-1, seq), labels.reshape(-1, seq)
        else:
            ids, labels = ids[:, :seq], labels[:, :seq]
        logits = model(ids.contiguous())
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], CLIP)
        for group in opt.param_groups:
            group["lr"] = schedule(step, steps)
        opt.step()
        losses.append(loss.item())
        lengths.append(seq)
    return losses, lengths


def _run(plans, data, steps, out, *extra, interpret=True, spec=LINEAR):
    return ["run", *(["--interpret"] if interpret else []), plans, "--curriculum", spec, "--steps", str(steps),
            "--data", data, *TRAIN, "--metrics", str(out), "-q", *extra]


def _matches_plain(rows, plain, lengths):
    assert [r["step"] for r in rows] == list(range(1, len(plain) + 1))
    assert [r["seq"] for r in rows] == lengths
    for r, want in zip(rows, plain):
        assert abs(r["loss"] - want) <= TOL, (r["step"], r["seq"], r["loss"], want)


def _switches(lengths):
    return sum(a != b for a, b in zip(lengths, lengths[1:]))


# ------------------------------------------------------------------- the schedules themselves


def test_the_schedules_are_deepspeeds():
    for spec, steps in ((LINEAR, 12), ("fixed_root:8:64:20", 25), ("fixed_root:16:256:30:3", 35),
                        ("fixed_linear:64:512:100", 120), (DISCRETE, 9), ("fixed_discrete:64,32,128:5,10", 12)):
        ours, theirs = parse_curriculum(spec), scheduler(spec)
        assert [ours.difficulty(s) for s in range(steps)] == [theirs.update_difficulty(s + 1) for s in range(steps)], spec
    # by hand: fixed_linear 64 -> 512 over 100 steps, multiples of 8, END from step 100 on
    c = parse_curriculum("fixed_linear:64:512:100")
    assert [c.difficulty(s) for s in (0, 1, 9, 49, 98, 99, 150)] == [64, 72, 104, 288, 504, 512, 512]
    # square root: faster at first; rounded to the bundle's lengths
    r = parse_curriculum("fixed_root:64:512:100")
    assert [r.difficulty(s) for s in (0, 3, 24)] == [104, 152, 288]
    assert [r.length(s, (64, 128, 256, 512)) for s in (0, 3, 24, 99)] == [64, 128, 256, 512]
    # a discrete schedule going down is followed until it has reached its largest length
    d = parse_curriculum("fixed_discrete:64,32,128:5,10")
    assert [d.difficulty(s) for s in (0, 4, 5, 9, 10, 11)] == [64, 64, 32, 32, 128, 128]


def test_truncate_and_reshape_cut_the_batch_as_megatron_does():
    tokens = torch.arange(2 * 33).reshape(2, 33)
    t = shape_batch(tokens, 8, "seqlen_truncate")
    assert torch.equal(t[:, :-1], tokens[:, :-1][:, :8]) and torch.equal(t[:, 1:], tokens[:, 1:][:, :8])
    r = shape_batch(tokens, 8, "seqlen_reshape")
    assert r.shape == (8, 9)
    assert torch.equal(r[:, :-1], tokens[:, :-1].reshape(-1, 8)) and torch.equal(r[:, 1:], tokens[:, 1:].reshape(-1, 8))
    assert torch.equal(shape_batch(tokens, 32, "seqlen_reshape"), tokens)


@pytest.mark.parametrize("spec, message", [
    ("linear:8:32:8", "unknown schedule 'linear'"),
    ("fixed_linear:8:32", "fixed_linear takes START:END:STEPS"),
    ("fixed_linear:12:32:8", "START 12 is not a multiple of 8"),
    ("fixed_linear:32:8:8", "START 32 must be below END 8"),
    ("fixed_discrete:8,16:3,6", "2 lengths need 1 max steps"),
    ("fixed_root:8:x:4", "END 'x' is not a whole number"),
])
def test_a_misspelt_curriculum_names_the_flag(files, spec, message, tmp_path, capsys):
    plans, _, data = files
    assert main(_run(plans, data, 6, tmp_path / "m.jsonl", spec=spec)) == 1
    err = capsys.readouterr().err
    assert err.startswith("--curriculum: error: ") and message in err, err


# -------------------------------------------------------------------- parity with plain torch


@pytest.fixture(scope="module")
def whole(files, tmp_path_factory):
    """The 12-step interpreter run never stopped, saving at steps 6 and 12: metrics, checkpoints."""
    plans, _, data = files
    d = tmp_path_factory.mktemp("whole")
    assert main(_run(plans, data, 12, d / "m.jsonl", "--checkpoint-dir", str(d / "ck"), "--save-every", "6")) == 0
    return metrics(d / "m.jsonl"), d / "ck"


def test_interpreter_matches_plain_pytorch_across_plan_switches(files, whole):
    _, _, data = files
    plain, lengths = plain_curriculum(data, LINEAR, 12)
    assert lengths == [8, 8, 16, 16, 16, 16, 16, 32, 32, 32, 32, 32] and _switches(lengths) == 2
    _matches_plain(whole[0], plain, lengths)


def test_reshape_keeps_the_tokens_of_a_step_and_matches_plain_pytorch(files, tmp_path):
    _, reshape, data = files
    out = tmp_path / "m.jsonl"
    assert main(_run(reshape, data, 8, out, "--curriculum-type", "seqlen_reshape", spec=DISCRETE)) == 0
    plain, lengths = plain_curriculum(data, DISCRETE, 8, reshape=True)
    assert lengths == [8, 8, 8, 16, 16, 16, 32, 32]
    rows = metrics(out)
    _matches_plain(rows, plain, lengths)
    assert [r["tokens_per_s"] * r["step_time"] for r in rows] == pytest.approx([BATCH * 32] * 8, rel=1e-9)


def test_stop_and_resume_in_the_middle_of_the_curriculum(files, whole, tmp_path, monkeypatch):
    plans, _, data = files
    ck, out = tmp_path / "ck", tmp_path / "m.jsonl"
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "save_checkpoint", stopping_after(5))  # at length 16, before the switch to 32
        assert main(_run(plans, data, 12, out, "--checkpoint-dir", str(ck), "--save-every", "5")) == 130
    assert [r["seq"] for r in metrics(out)] == [8, 8, 16, 16, 16]
    from tpc.executors.training.checkpoint import latest_checkpoint, read_meta

    assert latest_checkpoint(ck).name == "step_000005"
    assert main(_run(plans, data, 12, out, "--checkpoint-dir", str(ck), "--save-every", "5", "--resume")) == 0
    got, want = metrics(out), whole[0]
    assert [(r["step"], r["seq"], r["loss"], r["lr"], r["grad_norm"]) for r in got] == \
           [(r["step"], r["seq"], r["loss"], r["lr"], r["grad_norm"]) for r in want]
    from tpc.executors.training.export import export_state_dict

    mine, _ = export_state_dict(ck)
    theirs, _ = export_state_dict(whole[1])
    assert read_meta(ck)["step"] == 12 and all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_resume_under_another_curriculum_is_refused(files, whole, tmp_path, capsys):
    plans, _, data = files
    ck = tmp_path / "ck"
    shutil.copytree(whole[1], ck)
    shutil.rmtree(ck / "step_000012")
    (ck / "latest").write_text("step_000006")
    assert main(_run(plans, data, 12, tmp_path / "m.jsonl", "--checkpoint-dir", str(ck), "--resume",
                     spec="fixed_linear:8:32:20")) == 1
    err = capsys.readouterr().err
    assert "--curriculum: error: --resume: " in err and f"trained with --curriculum {LINEAR} --curriculum-type seqlen_truncate" in err
    assert not (tmp_path / "m.jsonl").exists()  # nothing trained


def test_two_gloo_ranks_match_plain_pytorch_and_resume_mid_curriculum(files, tmp_path):
    """pp=2 under the distributed executor: stopped after step 6 (length 16), resumed to 12
    (switching to 32): every loss plain PyTorch's within 1e-4, and the interpreter's run."""
    plans, _, data = files
    argv = ["run", plans, "--curriculum", LINEAR, "--steps", "12", "--data", data, *TRAIN, "--timeout", "60",
            "--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "6", "--metrics", str(tmp_path / "m.jsonl"), "-q"]
    codes, errs = launch(2, tmp_path, run_cli_rank, argv, 6, limit=300)
    assert codes == [130, 130], errs
    assert [r["seq"] for r in metrics(tmp_path / "m.jsonl")] == [8, 8, 16, 16, 16, 16]
    codes, errs = launch(2, tmp_path, run_cli_rank, argv + ["--resume"], limit=300)
    assert codes == [0, 0], errs
    plain, lengths = plain_curriculum(data, LINEAR, 12)
    _matches_plain(metrics(tmp_path / "m.jsonl"), plain, lengths)


# ------------------------------------------------------------------------------- refusals


def test_a_length_the_bundle_lacks_is_refused_before_any_communication(files, capsys, monkeypatch):
    """Run as rank 0 of 2 under torchrun's environment: refused before joining the group (a rank
    that joined would wait for its peer until --timeout)."""
    plans, _, data = files
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)
    assert main(["run", plans, "--curriculum", "fixed_linear:8:64:8", "--steps", "4", "--data", data,
                 "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    index = Path(plans) / "index.tpir"
    assert f"{index}:11:1: error: --curriculum fixed_linear:8:64:8: asks for length 64, and the bundle " \
           "has plans of lengths 8, 16, 32 only" in err, err
    assert "hint: recompile the bundle with 64 among --seq-len" in err
    assert not torch.distributed.is_initialized()


def _edited_bundle(plans: str, tmp_path: Path, seq: int, old: str, new: str) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(plans, copy)
    member = copy / f"seq{seq}.tpir"
    text = member.read_text()
    assert old in text
    member.write_text(text.replace(old, new, 1))
    return copy


def test_plans_that_disagree_on_the_split_or_the_model_are_refused(files, tmp_path, capsys, monkeypatch):
    plans, _, data = files
    # another stage split in the plan of length 16
    split = _edited_bundle(plans, tmp_path / "a", 16, "units 0:2", "units 0:1")
    split16 = split / "seq16.tpir"
    split16.write_text(split16.read_text().replace("units 2:4", "units 1:4", 1))
    assert main(["verify", str(split)]) == 1
    err = capsys.readouterr().err
    assert f"{split16}:7:1: error: this plan's stage split (stage 0 rank 0 units 0:1, stage 1 rank 1 units 1:4) " \
           "is not the bundle's (stage 0 rank 0 units 0:2, stage 1 rank 1 units 2:4) (the index's line 6); " \
           f"this plan is listed at {split / 'index.tpir'}:10:1" in err, err
    # another model hash in the plan of length 8, run as rank 0 of 2 under torchrun's environment
    sha = _edited_bundle(plans, tmp_path / "b", 8, 'sha256 "b', 'sha256 "c')
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["run", str(sha), "--curriculum", LINEAR, "--steps", "2", "--data", data, "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert f"{sha / 'seq8.tpir'}:2:1: error: this plan's model (" in err and "is not the bundle's (" in err, err
    assert not torch.distributed.is_initialized()  # refused before joining any process group


def test_a_bundle_and_a_curriculum_go_together(files, tmp_path, capsys):
    plans, reshape, data = files
    assert main(["run", "--interpret", plans, "--steps", "1"]) == 1
    assert "is a plan bundle: which plan runs at which step is the curriculum's to say" in capsys.readouterr().err
    assert main(["run", "--interpret", f"{plans}/seq8.tpir", "--curriculum", LINEAR]) == 1
    assert "--curriculum: error: --curriculum switches between the plans of a bundle" in capsys.readouterr().err
    # seqlen_reshape on a bundle of equal batches: located at the plan line that does not fit
    assert main(_run(plans, data, 6, tmp_path / "m.jsonl", "--curriculum-type", "seqlen_reshape")) == 1
    err = capsys.readouterr().err
    assert f"{plans}/index.tpir:9:1: error: --curriculum-type seqlen_reshape cuts each sequence of 32 tokens" in err
    assert main(_run(reshape, data, 6, tmp_path / "m.jsonl")) == 1
    assert f"{reshape}/index.tpir:9:1: error: --curriculum-type seqlen_truncate keeps the batch" in capsys.readouterr().err


def test_validation_under_a_curriculum_is_the_full_length_plans_and_changes_no_step(files, whole, tmp_path):
    """--eval-data with --curriculum runs the longest plan's evaluation program (one training
    loop wires it for one plan and for a bundle alike): before the first step it is plain
    PyTorch's loss of the initial model on the validation batches at the full length, and the
    training steps are those of the run without it."""
    from tests.executors.test_evaluation import plain_eval_loss, val_file
    from tpc.executors.training.eval_data import EvalBatches

    plans, _, data = files
    val = val_file(tmp_path / "val")
    out = tmp_path / "m.jsonl"
    assert main(_run(plans, data, 12, out, "--eval-data", val, "--eval-every", "6", "--eval-batches", "2")) == 0
    rows = metrics(out)
    evals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    assert [s for s, _ in evals] == [0, 6, 12]
    batches = EvalBatches(val, batch=BATCH, seq=max(LENGTHS), vocab=256, count=2, train_data=data)
    assert abs(evals[0][1] - plain_eval_loss(initial_model(), batches)) <= TOL
    assert evals[-1][1] != evals[0][1]
    steps = [(r["step"], r["seq"], r["loss"]) for r in rows if "loss" in r]
    assert steps == [(r["step"], r["seq"], r["loss"]) for r in whole[0]]
