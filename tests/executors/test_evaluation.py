"""The evaluation program run by both executors: the validation loss of a plan equals plain
PyTorch's `model.eval()` loss on the same batches (interpreter and torchrun, sliced and unsliced,
pipeline and pipeline x data); evaluating changes nothing training reads (a run with evaluation
trains bit-identically to one without); a bad validation file is refused before training."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.executors.dist_harness import torchrun_many
from tests.executors.real import fresh_model, real_plan
from tpc.cli.main import main
from tpc.compiler.lowering.eval_program import eval_program
from tpc.executors.interpreter import interpret
from tpc.executors.options import RunOptions
from tpc.executors.oracle import logits_of
from tpc.executors.training.eval_data import EvalBatches
from tpc.ir.nodes import Microbatch
from tpc.ir.printer import print_plan
from tpc.executors.training_loop import CheckpointHook

SEQ, BATCH, K = 16, 4, 2
TOL = 1e-6


def val_file(folder: Path, n: int = 2000, vocab: int = 256, meta: dict | None = None, seed: int = 1) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(seed).integers(0, vocab, n).astype(np.uint16).tofile(folder / "val.bin")
    np.random.default_rng(seed + 1).integers(0, vocab, 4000).astype(np.uint16).tofile(folder / "train.bin")
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta))
    return str(folder / "val.bin")


def eval_plan(name: str, *, dp: int = 1, eval_slices=None, schedule: str = "seq1f1b", tensor: int = 1,
              sequence: bool = False, overlap: bool = False):
    """A pp=2 plan of tiny_NAME whose evaluation program has its own slicing: `eval_slices`
    for each of its micro-batches (None: the training program's micro-batches). `overlap`:
    `--tensor-overlap`, in both programs."""
    plan = real_plan(name, stages=2, microbatches=2, slices="2", schedule=schedule, dp=dp,
                     seq_len=SEQ, batch=BATCH, tensor=tensor, sequence=sequence, overlap=overlap)
    h = plan.header
    mbs = None
    if eval_slices is not None:
        size = h.replica_batch // len(eval_slices)
        mbs = tuple(Microbatch(index=m, size=size, slices=tuple(s)) for m, s in enumerate(eval_slices))
    return dataclasses.replace(plan, eval=eval_program(h, mbs, pairs=overlap))


def plain_eval_loss(model: torch.nn.Module, batches: EvalBatches) -> float:
    """Plain PyTorch: `model.eval()`, the mean over the batches of the mean token loss."""
    model.eval()
    losses = []
    with torch.no_grad():
        for k in range(batches.count):
            tokens = batches.get(k)
            logits = logits_of(model(tokens[:, :-1]))
            losses.append(float(F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                                tokens[:, 1:].reshape(-1))))
    return sum(losses) / len(losses)


THREE = [[(0, 5), (5, 11), (11, 16)]]  # one micro-batch of all rows, three unequal slices
CASES = {
    "pp2-sliced": dict(name="gpt", eval_slices=THREE),
    "pp2-unsliced": dict(name="gpt", eval_slices=[[(0, 16)], [(0, 16)]]),
    "pp2xdp2-sliced": dict(name="gpt", dp=2, eval_slices=[[(0, 7), (7, 16)]]),
    "pp2-dropout": dict(name="gpt_dropout", eval_slices=THREE),
    # two pipelines over weight replicas: the evaluation runs on replica 0's
    "pp2-chimera": dict(name="llama", eval_slices=THREE, schedule="chimera"),
    # each rank's evaluation stages share its parts of the weights with its training stages
    "pp2xtp2-sliced": dict(name="gpt", tensor=2, eval_slices=THREE),
    # and with sequence parallelism: slices of even lengths, each rank's half of their tokens
    "pp2xtp2-sp-sliced": dict(name="gpt", tensor=2, sequence=True, eval_slices=[[(0, 6), (6, 12), (12, 16)]]),
    # slice pairs, each one program whose collectives overlap the other slice's compute
    "pp2xtp2-pairs": dict(name="gpt", tensor=2, overlap=True, eval_slices=[[(0, 4), (4, 8), (8, 12), (12, 16)]]),
}


@pytest.mark.parametrize("case", CASES)
def test_interpreter_eval_loss_is_plain_pytorch(case, tmp_path):
    kw = dict(CASES[case])
    name = kw.pop("name")
    plan = eval_plan(name, **kw)
    batches = EvalBatches(val_file(tmp_path), batch=BATCH, seq=SEQ, vocab=256, count=K)
    model, sliced = fresh_model(name)
    res = interpret(plan, RunOptions(steps=2, eval_every=1, eval_data="val.bin", lr_schedule="constant"),
                    model=model, sliced=sliced, eval_batches=batches)
    assert [d for d, _ in res.eval_losses] == [0, 1, 2]
    before = plain_eval_loss(fresh_model(name)[0], batches)
    assert abs(res.eval_losses[0][1] - before) <= TOL
    trained = fresh_model(name)[0]
    trained.load_state_dict(res.state_dict)
    assert abs(res.eval_losses[-1][1] - plain_eval_loss(trained, batches)) <= TOL
    assert res.eval_losses[-1][1] != res.eval_losses[0][1]  # the weights did change


def test_the_evaluation_runs_slice_pairs_as_one_program_each_and_computes_what_the_plain_plan_computes(tmp_path):
    """`--tensor-overlap` in the evaluation program: each pair of forwards is one program
    (`evaluate_pair`, counted) and the evaluation losses are the plain plan's, bit for bit."""
    from tpc.executors.stage_runtime import StageRuntime

    four = [[(0, 4), (4, 8), (8, 12), (12, 16)]]
    batches = EvalBatches(val_file(tmp_path), batch=BATCH, seq=SEQ, vocab=256, count=K)
    losses, pairs = [], []
    original = StageRuntime.evaluate_pair

    def counted(self, *a, **k):
        pairs.append(a[:2])
        return original(self, *a, **k)

    for overlap in (False, True):
        model, sliced = fresh_model("gpt")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(StageRuntime, "evaluate_pair", counted)
            res = interpret(eval_plan("gpt", tensor=2, overlap=overlap, eval_slices=four),
                            RunOptions(steps=1, eval_every=1, eval_data="val.bin"), model=model, sliced=sliced,
                            eval_batches=batches)
        losses.append(res.eval_losses)
    # 2 evaluations x K batches x 2 stages x 2 pairs x 2 tensor ranks, all in the plan with pairs
    assert len(pairs) == 2 * K * 2 * 2 * 2
    assert losses[0] == losses[1]


class _Engines(CheckpointHook):
    """Stands where `RunCheckpoints` would: keeps the training engines to look at afterwards."""

    def start(self, engines):
        self.engines = engines
        return 0


def _optimizer_state(engines) -> list[torch.Tensor]:
    out = []
    for e in engines:
        for state in e.optimizer.opt.state.values():
            out += [torch.as_tensor(v) for _, v in sorted(state.items())]
    return out


def test_evaluation_changes_nothing_training_reads(tmp_path):
    """Dropout makes training draw random masks: a run that evaluates after every step trains
    bit-identically to one that never does (losses, weights, gradients, AdamW state), and leaves
    the random stream where the run without it leaves it."""
    plan = eval_plan("gpt_dropout", eval_slices=THREE)
    batches = EvalBatches(val_file(tmp_path), batch=BATCH, seq=SEQ, vocab=256, count=K)
    runs = []
    for evaluate in (False, True):
        model, sliced = fresh_model("gpt_dropout")
        torch.manual_seed(123)
        opts = RunOptions(steps=3, eval_every=1 if evaluate else 0, eval_data="val.bin" if evaluate else None)
        kept = _Engines()
        res = interpret(plan, opts, model=model, sliced=sliced, eval_batches=batches if evaluate else None,
                        checkpoints=kept)
        runs.append((res, torch.get_rng_state(), _optimizer_state(kept.engines)))
    (plain, rng_plain, opt_plain), (evaluated, rng_evaluated, opt_evaluated) = runs
    assert len(opt_plain) == len(opt_evaluated) > 0
    assert all(torch.equal(a, b) for a, b in zip(opt_plain, opt_evaluated))
    assert len(evaluated.eval_losses) == 4 and not plain.eval_losses
    assert plain.losses == evaluated.losses
    assert plain.state_dict.keys() == evaluated.state_dict.keys()
    assert all(torch.equal(plain.state_dict[k], evaluated.state_dict[k]) for k in plain.state_dict)
    assert all(torch.equal(plain.grads[k], evaluated.grads[k]) for k in plain.grads)
    assert torch.equal(rng_plain, rng_evaluated)


# ------------------------------------------------------------------------------ the command


@pytest.fixture
def no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _write(tmp_path: Path, plan) -> str:
    out = tmp_path / "plan.tpir"
    out.write_text(print_plan(plan), encoding="utf-8")
    return str(out)


def test_interpret_command_metrics_and_save_best(tmp_path, capsys, no_torchrun):
    plan = _write(tmp_path, eval_plan("gpt", eval_slices=THREE))
    val = val_file(tmp_path / "data", meta={"dtype": "uint16", "vocab": 256, "tokenizer": "bytes"})
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    assert main(["run", "--interpret", plan, "--steps", "4", "--data", str(tmp_path / "data" / "train.bin"),
                 "--eval-data", val, "--eval-every", "2", "--eval-batches", str(K), "--metrics", str(metrics),
                 "--checkpoint-dir", str(ckpt), "--save-best", "--lr", "3e-3"]) == 0
    out = capsys.readouterr().out
    assert "validation after 0 steps: val " in out and " ppl " in out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 2, 4]
    assert all(abs(r["val_ppl"] - np.exp(r["val_loss"])) < 1e-9 * r["val_ppl"] for r in rows if "val_loss" in r)
    best = min((r for r in rows if "val_loss" in r and r["step"] > 0), key=lambda r: r["val_loss"])
    meta = json.loads((ckpt / "best" / "tpc.json").read_text())
    assert meta["step"] == best["step"] and meta["val_loss"] == best["val_loss"]
    assert (ckpt / "latest").read_text().strip() == "step_000004"


@pytest.mark.parametrize("bad", ["vocabulary", "tokens", "short", "no-eval-program", "options"])
def test_bad_validation_input_is_refused_before_training(bad, tmp_path, capsys, no_torchrun):
    plan_obj = eval_plan("gpt", eval_slices=THREE)
    args = ["--eval-batches", str(K)]
    if bad == "vocabulary":  # a corpus of another tokenizer, said by its meta.json
        val = val_file(tmp_path / "other", meta={"dtype": "uint16", "vocab": 50257, "tokenizer": "gpt2"})
        expect = "vocabulary of 50257"
    elif bad == "tokens":  # no meta.json: ids past the model's vocabulary
        val = val_file(tmp_path / "ids", vocab=1000)
        expect = "outside the model's vocabulary of 256"
    elif bad == "short":
        val = val_file(tmp_path / "short", n=100)
        args = ["--eval-batches", "3"]
        expect = "too few for --eval-batches 3"
    elif bad == "no-eval-program":
        val = val_file(tmp_path / "ok")
        plan_obj = dataclasses.replace(plan_obj, eval=None)
        expect = "has no evaluation program"
    else:
        val = None
        args = ["--eval-every", "5"]
        expect = "--eval-every needs --eval-data"
    plan = _write(tmp_path, plan_obj)
    metrics = tmp_path / "m.jsonl"
    cmd = ["run", "--interpret", plan, "--steps", "2", "--metrics", str(metrics), *args]
    if val:
        cmd += ["--eval-data", val]
    assert main(cmd) == 1
    captured = capsys.readouterr()
    assert expect in captured.err + captured.out
    assert "step 1/2" not in captured.out and not metrics.exists()  # refused before training


# ------------------------------------------------------------------------------- torchrun


TORCHRUN = {  # case: (model, schedule, data replicas, evaluation slices); 2 x replicas processes
    "pp2-sliced": ("gpt", "seq1f1b", 1, THREE),
    "pp2xdp2-unsliced": ("gpt", "seq1f1b", 2, [[(0, 16)]]),
    "pp2-chimera": ("llama", "chimera", 1, THREE),
}


@pytest.mark.parametrize("world", sorted({2 * c[2] for c in TORCHRUN.values()}), ids=lambda n: f"{n}-ranks")
def test_torchrun_eval_loss_is_the_interpreters_and_plain_pytorch(world, tmp_path):
    """The cases of one world size share one torchrun launch (dist_harness.torchrun_many); each
    is checked on its own, by name."""
    cases = {case: c for case, c in TORCHRUN.items() if 2 * c[2] == world}
    plans = {case: eval_plan(name, dp=dp, eval_slices=eval_slices, schedule=schedule)
             for case, (name, schedule, dp, eval_slices) in cases.items()}
    val = val_file(tmp_path / "data")
    batches = EvalBatches(val, batch=BATCH, seq=SEQ, vocab=256, count=K)
    torchrun_many(plans, tmp_path, ["--steps", "2", "--eval-data", val, "--eval-every", "1", "--eval-batches", str(K),
                                    "--metrics", "{case}/m.jsonl", "--timeout", "60", "--device", "cpu",
                                    "--lr-schedule", "constant"])
    for case, (name, *_) in cases.items():
        rows = [json.loads(line) for line in (tmp_path / "cases" / case / "m.jsonl").read_text().splitlines()]
        model, sliced = fresh_model(name)
        res = interpret(plans[case], RunOptions(steps=2, eval_every=1, eval_data=val, lr_schedule="constant"),
                        model=model, sliced=sliced, eval_batches=batches)
        got = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        assert [s for s, _ in got] == [s for s, _ in res.eval_losses] == [0, 1, 2], case
        assert all(abs(a - b) <= TOL for (_, a), (_, b) in zip(got, res.eval_losses)), (case, got, res.eval_losses)
        assert abs(got[0][1] - plain_eval_loss(fresh_model(name)[0], batches)) <= TOL, case
        trained = fresh_model(name)[0]
        trained.load_state_dict(res.state_dict)
        assert abs(got[-1][1] - plain_eval_loss(trained, batches)) <= TOL, case


@pytest.mark.parametrize("family", ["starcoder2", "lfm2"])
def test_hugging_face_windowed_caches_evaluate_as_plain_pytorch(family, tmp_path):
    """Code nobody here wrote: a sliding window of 4 in every layer (starcoder2) and short causal
    convolutions (lfm2) keep only a window of their cache; the evaluation's slices (5, 6, 5
    tokens) read it as training's do."""
    import copy

    from tests.compiler.frontend.hf_models import config_dict
    from tests.executors.real import traced

    config = tmp_path / family / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(config_dict(family)))
    plan = real_plan(family, path=str(config), stages=2, microbatches=2, slices="2", schedule="seq1f1b",
                     seq_len=SEQ, batch=BATCH)
    plan = dataclasses.replace(plan, eval=eval_program(plan.header, (Microbatch(0, BATCH, tuple(THREE[0])),)))
    vocab = plan.header.shape.vocab
    batches = EvalBatches(val_file(tmp_path / "data", vocab=vocab), batch=BATCH, seq=SEQ, vocab=vocab, count=K)
    model, sliced, _ = traced(str(config), SEQ)
    res = interpret(plan, RunOptions(steps=2, eval_every=2, eval_data="val.bin"), model=copy.deepcopy(model),
                    sliced=sliced, eval_batches=batches)
    assert abs(res.eval_losses[0][1] - plain_eval_loss(copy.deepcopy(model), batches)) <= TOL
    trained = copy.deepcopy(model)
    trained.load_state_dict(res.state_dict)
    assert abs(res.eval_losses[-1][1] - plain_eval_loss(trained, batches)) <= TOL
