"""A checkpoint outlives the plan that wrote it: training N steps under one plan and resuming under
another plan of the same model (other slices and schedule, another pipeline depth and stage
split, data-parallel replicas, one rank, a tie on other stages) is exactly plain PyTorch resumed
from the same checkpoint:

- right after the resume, every copy of every parameter (the replicas', each rank's copy of a
  tie) and its AdamW state are the checkpoint's, bit for bit;
- the next step's loss is that of the unsliced model loaded with the checkpoint's weights, and
  the weights and AdamW state after it are those of `torch.optim.AdamW` loaded with the
  checkpoint's state taking the same step (fp32: relative 1e-5);
- the steps before the checkpoint were plain PyTorch's too (losses within 1e-5).

The oracle reads the checkpoint with torch.distributed.checkpoint itself, by the documented keys
(params.NAME, optim.NAME.KEY). Each round trip runs in the interpreter; one runs in real gloo
processes (2x2 written, 4x1 read, every process reading only its own stages' parameters).

The models have no biases: a key projection's bias has a gradient that is zero in exact
arithmetic, so AdamW turns its rounding noise into steps of about the learning rate whose sign
the summation order picks, and no two implementations agree on it element by element.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from tests.executors.dist_harness import launch
from tests.executors.real import fresh_model, real_plan
from tpc.executors.interpreter import interpret
from tpc.executors.options import RunOptions
from tpc.executors.training.batches import RandomTokens
from tpc.executors.training.model_state import engine_parameters
from tpc.executors.training.optimizer import OptimSpec
from tpc.executors.training.run_checkpoints import RunCheckpoints
from tpc.ir.printer import print_plan

SEQ, BATCH, LR, WD, CLIP = 16, 4, 3e-3, 0.1, 0.5
N = 3  # steps before the checkpoint
REL = 1e-5
STATE = ("step", "exp_avg", "exp_avg_sq")


def options(steps: int, ck: Path, resume: bool = False) -> RunOptions:
    return RunOptions(steps=steps, seed=0, optim=OptimSpec("adamw", lr=LR, weight_decay=WD), lr_schedule="constant",
                      grad_clip=CLIP, device="cpu", checkpoint_dir=str(ck), resume=resume, quiet=True)


def batches() -> RandomTokens:
    return RandomTokens(0, BATCH, SEQ, 256)


# ------------------------------------------------------------------------------ the oracle


def read_checkpoint(step_dir: Path, names) -> tuple[dict, dict]:
    """Weights and AdamW state of a format-2 checkpoint, read with DCP by their keys."""
    model, _ = fresh_model(names)
    flat = {}
    for n, p in model.named_parameters():
        flat[f"params.{n}"] = torch.empty_like(p.detach())
        flat[f"optim.{n}.step"] = torch.zeros(())
        flat[f"optim.{n}.exp_avg"] = torch.empty_like(p.detach())
        flat[f"optim.{n}.exp_avg_sq"] = torch.empty_like(p.detach())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(flat, checkpoint_id=str(step_dir), no_dist=True)
    params = {k[len("params."):]: v for k, v in flat.items() if k.startswith("params.")}
    state = {n: {k: flat[f"optim.{n}.{k}"] for k in STATE} for n in params}
    return params, state


def adamw(named):
    """The optimizer `tpc run --optimizer adamw` means, over (name, parameter) pairs."""
    named = sorted(named)
    return torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": WD},
                              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.95), foreach=False)


def plain_step(model, opt, step: int) -> float:
    tokens = batches().get(step)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP)
    opt.step()
    return loss.item()


def plain_losses(name: str, steps: int) -> list[float]:
    model, _ = fresh_model(name)
    opt = adamw(model.named_parameters())
    return [plain_step(model, opt, s) for s in range(steps)]


def plain_resumed(name: str, step_dir: Path, step: int):
    """Plain PyTorch resumed from a checkpoint: the unsliced model and torch's AdamW loaded with
    its weights and state take step `step`. Returns the loss and the weights and state after it."""
    model, _ = fresh_model(name)
    params, state = read_checkpoint(step_dir, name)
    named = dict(model.named_parameters())
    opt = adamw(named.items())
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(params[n])
            opt.state[p] = {k: v.clone() for k, v in state[n].items()}
    loss = plain_step(model, opt, step)
    return loss, {n: p.detach() for n, p in named.items()}, {n: opt.state[p] for n, p in named.items()}


class Watch:
    """RunCheckpoints as the interpreter uses it, keeping a copy of every engine's parameters and
    optimizer state right after the run started (resumed)."""

    def __init__(self, inner: RunCheckpoints):
        self.inner, self.lines = inner, []
        inner.say = self.lines.append
        # (name, value, AdamW state, how it is cut over the tensor axis or None, tensor rank)
        self.after_start: list[tuple[str, torch.Tensor, dict, object, int]] = []

    def start(self, engines):
        step = self.inner.start(engines)
        for e in engines:
            opt = e.optimizer.opt
            for name, p in engine_parameters(e):
                state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state.get(p, {}).items()}
                shard = e.tensor.split(name) if e.tensor is not None else None
                self.after_start.append((name, p.detach().clone(), state, shard, e.tensor_rank))
        return step

    def after_step(self, engines, done):
        return self.inner.after_step(engines, done)

    def lock(self):
        self.inner.lock()

    def unlock(self):
        self.inner.unlock()


def train(plan, name: str, steps: int, ck: Path, resume: bool = False):
    """`tpc run --interpret` of `plan` (library form): losses, and what it held after starting."""
    model, sliced = fresh_model(name)
    opts = options(steps, ck, resume)
    watch = Watch(RunCheckpoints.from_options(plan, opts, model=model))
    losses = []
    interpret(plan, opts, model=model, sliced=sliced, batches=batches(), checkpoints=watch,
              on_step=lambda step, loss, info: losses.append(loss))
    return losses, watch


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=REL, atol=REL * float(b.abs().max()))


def check_resumed(watch: Watch, step_dir: Path, name: str):
    """Every copy right after the resume holds the checkpoint's weights and AdamW state exactly."""
    params, state = read_checkpoint(step_dir, name)
    seen = set()
    for n, value, mine, shard, t in watch.after_start:
        seen.add(n)

        def part(whole):  # a tensor rank holds its part of a weight cut over the tensor axis
            return whole if shard is None or whole.dim() == 0 else shard.take(whole, t)

        assert torch.equal(value, part(params[n])), n
        assert set(mine) == set(STATE), n
        assert all(torch.equal(mine[k], part(state[n][k])) for k in STATE), n
    assert seen == set(params)  # the new plan's stages hold every parameter


def check_next_step(loss: float, name: str, before: Path, after: Path):
    """The step after the resume is plain PyTorch's step from the same checkpoint."""
    want_loss, want_params, want_state = plain_resumed(name, before, N)
    assert loss == pytest.approx(want_loss, rel=REL)
    params, state = read_checkpoint(after, name)
    for n in want_params:
        assert close(params[n], want_params[n]), n
        for k in STATE:
            assert close(state[n][k], want_state[n][k]), (n, k)


# model, plan written, plan read
CASES = {
    "slices 2 -> 4, 1f1b -> seq1f1b": ("gpt_nobias", dict(stages=2, microbatches=2, slices="2", schedule="1f1b"),
                                       dict(stages=2, microbatches=2, slices="4", schedule="seq1f1b")),
    "pipe 2 -> 4": ("llama", dict(stages=2, microbatches=1, slices="2", schedule="gpipe"),
                    dict(stages=4, microbatches=2, slices="2", schedule="seq1f1b")),
    "2x1 -> 2x2 (data parallel)": ("gpt_nobias", dict(stages=2, microbatches=2, slices="2", schedule="seq1f1b"),
                                   dict(stages=2, microbatches=1, slices="3", schedule="1f1b", dp=2)),
    "4x1 -> 1x1": ("gpt_nobias", dict(stages=4, microbatches=2, slices="2", schedule="seq1f1b"),
                   dict(stages=1, microbatches=1, slices="1", schedule="gpipe")),
    # the tie (embedding = head) on stages 0, 1 of ranks 0, 1, then on stages 0, 3 of ranks 0, 1
    "tie on moved stages": ("gpt_nobias", dict(stages=2, microbatches=2, slices="2", schedule="seq1f1b"),
                            dict(stages=4, microbatches=2, slices="2", schedule="interleaved", ranks=2)),
    # chimera's two weight replicas of every stage: written (each parameter once), and read into
    # both replicas
    "chimera 4x1 -> 1f1b 2x1": ("llama", dict(stages=4, microbatches=2, slices="2,5,9", schedule="chimera"),
                                dict(stages=2, microbatches=2, slices="2", schedule="1f1b")),
    "seq1f1b 2x1 -> chimera 4x1": ("llama", dict(stages=2, microbatches=2, slices="2", schedule="seq1f1b"),
                                   dict(stages=4, microbatches=4, slices="3", schedule="chimera")),
    # chimera with a tie (embedding = head on stages 0 and 3, both on ranks 0 and 3): the tied
    # weight written once, read into each of the four copies
    "chimera tied 4x1 -> seq1f1b 2x1": ("gpt_nobias", dict(stages=4, microbatches=4, slices="2,9,5",
                                                          schedule="chimera"),
                                        dict(stages=2, microbatches=2, slices="2", schedule="seq1f1b")),
    "1f1b 2x1 -> chimera tied 4x1": ("gpt_nobias", dict(stages=2, microbatches=2, slices="2", schedule="1f1b"),
                                     dict(stages=4, microbatches=2, slices="3", schedule="chimera")),
    # a tensor axis: each rank's part of the split weights and of their AdamW moments written as
    # rectangles of the whole tensor, read back at another tensor degree (none, or 2 with data
    # replicas); the tiny Llama's one key/value head is replicated over the 2 ranks
    "2x1 -> 2x1x2 (tensor parallel)": ("gpt_nobias", dict(stages=2, microbatches=2, slices="2", schedule="seq1f1b"),
                                       dict(stages=2, microbatches=2, slices="3", schedule="1f1b", tensor=2)),
    "2x1x2 -> 2x1 (tensor parallel)": ("llama", dict(stages=2, microbatches=2, slices="2", schedule="seq1f1b",
                                                     tensor=2),
                                       dict(stages=2, microbatches=1, slices="4", schedule="gpipe")),
    "2x1x2 -> 1x2x2 (tensor parallel)": ("gpt_nobias", dict(stages=2, microbatches=2, slices="2", schedule="1f1b",
                                                            tensor=2),
                                         dict(stages=1, microbatches=1, slices="2", schedule="gpipe", dp=2, tensor=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_under_another_plan_is_plain_pytorch(case, tmp_path):
    name, before, after = CASES[case]
    plan_a, plan_b = real_plan(name, **before), real_plan(name, **after)
    losses_a, _ = train(plan_a, name, N, tmp_path)
    assert losses_a == pytest.approx(plain_losses(name, N), rel=REL)

    losses_b, watch = train(plan_b, name, N + 1, tmp_path, resume=True)
    check_resumed(watch, tmp_path / "step_000003", name)
    check_next_step(losses_b[0], name, tmp_path / "step_000003", tmp_path / "step_000004")
    mesh_a, mesh_b = (f"{h.mesh.pipe}x{h.mesh.data}" + (f"x{h.mesh.tensor}" if h.mesh.tensor > 1 else "")
                      for h in (plan_a.header, plan_b.header))
    line = watch.lines[0]
    assert line.startswith(f"resuming step 3 of {tmp_path / 'step_000003'} ")
    assert (f"from a {mesh_a} mesh on a {mesh_b} mesh" if mesh_a != mesh_b else f"on the same {mesh_a} mesh") in line
    if case == "tie on moved stages":
        assert plan_a.header.ties[0].stages == (0, 1) and plan_b.header.ties[0].stages == (0, 3)


def test_the_line_says_what_differs(tmp_path):
    plan_a = real_plan("gpt_nobias", stages=2, microbatches=2, slices="2", schedule="1f1b")
    plan_b = real_plan("gpt_nobias", stages=2, microbatches=2, slices="4", schedule="seq1f1b")
    train(plan_a, "gpt_nobias", 1, tmp_path)
    _, watch = train(plan_b, "gpt_nobias", 2, tmp_path, resume=True)
    assert watch.lines[0] == (f"resuming step 1 of {tmp_path / 'step_000001'} on the same 2x1 mesh (pipe x data); "
                              "schedule 1f1b -> seq1f1b; slices 8,8 -> 4,4,4,4")
    _, watch = train(plan_b, "gpt_nobias", 3, tmp_path, resume=True)  # written by this very plan
    assert watch.lines[0] == f"resumed from {tmp_path / 'step_000002'} (step 2)"


# ------------------------------------------------------------------------------ torchrun


def _rank(rank: int, out_dir: str, plan_path: str, steps: int, ck: str) -> None:
    import sys

    from tpc.cli.main import main

    sys.stdout = open(Path(out_dir) / f"rank{rank}.out", "w")  # the progress and the resume line
    status = main(["run", plan_path, "--steps", str(steps), "--checkpoint-dir", ck, "--resume", "--lr-schedule",
                   "constant", "--lr", str(LR), "--weight-decay", str(WD), "--grad-clip", str(CLIP), "--device",
                   "cpu", "--metrics", str(Path(out_dir) / "m.jsonl"), "--timeout", "60"])
    sys.stdout.flush()
    sys.exit(status)


def test_gloo_ranks_resume_under_another_split(tmp_path):
    """A 2x2 checkpoint (written by the interpreter) resumed by two gloo processes on a plan of
    four stages interleaved over two ranks: rank 0 now holds units 0 and 2, rank 1 units 1 and 3
    and the tie's other end, each process reading only its own stages' parameters. The same
    checks as in the interpreter, on what the processes wrote."""
    name = "gpt_nobias"
    plan_a = real_plan(name, stages=2, microbatches=1, slices="2", schedule="seq1f1b", dp=2)
    losses_a, _ = train(plan_a, name, N, tmp_path / "ck")
    assert losses_a == pytest.approx(plain_losses(name, N), rel=REL)
    b = tmp_path / "b.tpir"
    b.write_text(print_plan(real_plan(name, stages=4, microbatches=2, slices="2", schedule="interleaved", ranks=2)))
    codes, errs = launch(2, tmp_path, _rank, str(b), N + 1, str(tmp_path / "ck"), limit=120)
    assert codes == [0, 0], errs
    out = (tmp_path / "rank0.out").read_text()
    assert f"resuming step 3 of {tmp_path / 'ck' / 'step_000003'} from a 2x2 mesh on a 2x1 mesh (pipe x data)" in out
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4]
    check_next_step(rows[0]["loss"], name, tmp_path / "ck" / "step_000003", tmp_path / "ck" / "step_000004")


# ------------------------------------------------------------------------------ format 1


def test_a_format_1_checkpoint_resumes_as_its_format_2_twin(tmp_path):
    """The same run saved in the format earlier versions wrote (one shard per rank) and in format
    2 resumes, under another plan, to bit-identical weights and AdamW state; both export alike."""
    from tests.executors.training.format1 import Format1Saver
    from tpc.executors.training.export import export_state_dict

    name = "gpt_nobias"
    plan_a = real_plan(name, stages=2, microbatches=2, slices="2", schedule="seq1f1b")
    plan_b = real_plan(name, stages=4, microbatches=2, slices="2", schedule="seq1f1b")
    old, new = tmp_path / "old", tmp_path / "new"
    model, sliced = fresh_model(name)
    interpret(plan_a, options(N, old), model=model, sliced=sliced, batches=batches(),
              checkpoints=Format1Saver(plan_a, old, N))
    assert json.loads((old / "step_000003" / "tpc.json").read_text())["format"] == 1
    train(plan_a, name, N, new)
    a, b = export_state_dict(old), export_state_dict(new)
    assert list(a[0]) == list(b[0]) and all(torch.equal(a[0][k], b[0][k]) for k in a[0])

    losses_old, watch = train(plan_b, name, N + 1, old, resume=True)
    losses_new, _ = train(plan_b, name, N + 1, new, resume=True)
    assert losses_old == losses_new
    assert watch.lines[0] == (f"resuming step 3 of {old / 'step_000003'} from a 2x1 mesh on a 4x1 mesh (pipe x data); "
                              "another plan (this checkpoint, of format 1, does not describe its plan)")
    params_old, state_old = read_checkpoint(old / "step_000004", name)
    params_new, state_new = read_checkpoint(new / "step_000004", name)
    for n in params_new:
        assert torch.equal(params_old[n], params_new[n]), n
        assert all(torch.equal(state_old[n][k], state_new[n][k]) for k in STATE), n
