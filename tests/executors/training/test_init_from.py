"""`tpc run --init-from`: weights from an exported .pt or .safetensors, a checkpoint directory or a
Hugging Face model directory start a run exactly where they came from: the first loss is the
exporting run's next loss, and a directory `save_pretrained` wrote gives Hugging Face's own loss.
`tpc export` writes safetensors and, for a Hugging Face model, a directory `from_pretrained`
loads back. Files that do not fit are refused with a located message before any step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.executors.real import fresh_model, real_plan
from tpc.cli.main import main
from tpc.compiler.frontend import load_model
from tpc.ir.printer import print_plan

SEQ, BATCH = 16, 4
# a Hugging Face Llama configuration: 2 layers, width 32, grouped-query attention, tied embeddings
HF_CONFIG = str(Path(__file__).resolve().parent / "models" / "hf_llama" / "config.json")
TRAIN = ["--lr", "3e-3", "--lr-schedule", "constant", "--seed", "0", "--device", "cpu", "-q"]


@pytest.fixture(autouse=True)
def no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def write(plan, path: Path) -> str:
    path.write_text(print_plan(plan), encoding="utf-8")
    return str(path)


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(plan: str, out: Path, *extra: str) -> int:
    return main(["run", "--interpret", plan, *TRAIN, "--metrics", str(out), *extra])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tied GPT trained 3 steps on a one-batch corpus (every step sees the same batch), its
    checkpoint exported as .pt and .safetensors, and its loss at step 4 (resumed)."""
    d = tmp_path_factory.mktemp("exported")
    plan = write(real_plan("gpt", stages=2, microbatches=2, slices="5,4,7", schedule="seq1f1b"), d / "plan.tpir")
    data = d / "one.bin"  # seq + 2 tokens: the only offset a row can start at is 0
    np.frombuffer(b"def f(x): return x * 2", dtype=np.uint8)[: SEQ + 2].astype(np.uint16).tofile(data)
    ck = d / "ck"
    assert run(plan, d / "a.jsonl", "--steps", "3", "--data", str(data), "--checkpoint-dir", str(ck)) == 0
    assert main(["export", str(ck), "-o", str(d / "gpt.pt")]) == 0
    assert main(["export", str(ck), "-o", str(d / "gpt.safetensors")]) == 0
    assert run(plan, d / "a.jsonl", "--steps", "4", "--data", str(data), "--checkpoint-dir", str(ck), "--resume") == 0
    return plan, str(data), d, metrics(d / "a.jsonl")[3]["loss"]


@pytest.mark.parametrize("source", ["gpt.pt", "gpt.safetensors", "ck/step_000003"])
def test_init_from_an_export_gives_the_exporting_runs_loss(exported, source, tmp_path):
    plan, data, d, loss_at_4 = exported
    out = tmp_path / "m.jsonl"
    assert run(plan, out, "--steps", "1", "--data", data, "--init-from", str(d / source)) == 0
    assert metrics(out)[0]["loss"] == loss_at_4  # the same weights on the same batch: the same number


def test_init_from_checks_gradients_from_the_same_weights(exported, capsys):
    plan, data, d, _ = exported
    assert main(["run", "--interpret", plan, "--data", data, "--init-from", str(d / "gpt.pt"), "--verify-grads",
                 "--device", "cpu", "-q"]) == 0
    assert ": ok" in capsys.readouterr().out


def test_safetensors_export_holds_a_tie_once_and_loads_with_the_model(exported):
    from safetensors import safe_open
    from safetensors.torch import load_model

    _, _, d, _ = exported
    with safe_open(str(d / "gpt.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # one tensor, its first name
    model, _ = fresh_model("gpt")
    load_model(model, str(d / "gpt.safetensors"))
    pt = torch.load(d / "gpt.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], pt[k]) for k in pt)
    assert json.loads((d / "gpt.safetensors.json").read_text())["step"] == 3


def test_each_rank_reads_only_its_stages_tensors(exported, monkeypatch):
    """An engine of pipeline rank 1 reads from the file exactly the parameters of its stage."""
    from tpc.executors.engine import RankEngine, stage_factory_from_model
    from tpc.executors.training import init_from

    _, _, d, _ = exported
    plan = real_plan("gpt", stages=2, microbatches=2, slices="5,4,7", schedule="seq1f1b")
    model, sliced = fresh_model("gpt")
    engine = RankEngine(plan, 1, 0, transport=None, stage_factory=stage_factory_from_model(sliced, model),
                        hidden_size=sliced.hidden_size)
    asked = []
    real_open = init_from.open_weights

    def spying(path):
        weights = real_open(path)
        real_read = weights.read
        weights.read = lambda names: asked.extend(names) or real_read(names)
        return weights

    monkeypatch.setattr(init_from, "open_weights", spying)
    init_from.init_engines([engine], d / "gpt.safetensors", init_from.ModelNames.of(model))
    mine = sorted(n for n, _ in engine.named_parameters)
    assert sorted(asked) == mine and len(mine) < len(dict(model.named_parameters()))
    assert "transformer.wte.weight" in mine  # the tie's second end lives on rank 1
    pt = torch.load(d / "gpt.pt", weights_only=True)
    assert all(torch.equal(p, pt[n]) for n, p in engine.named_parameters)


# ------------------------------------------------------------------------------ Hugging Face


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A plan compiled from a Hugging Face config.json and a directory save_pretrained wrote from
    a randomly initialised model of that configuration (other weights than seed 0's)."""
    d = tmp_path_factory.mktemp("hf")
    plan = write(real_plan("hf", path=HF_CONFIG, stages=2, microbatches=2, slices="2", schedule="seq1f1b"),
                 d / "plan.tpir")
    torch.manual_seed(123)
    pretrained = load_model(HF_CONFIG)  # what `tpc compile config.json` builds: a LlamaForCausalLM
    pretrained.save_pretrained(str(d / "pretrained"))
    return plan, d, pretrained


def hf_loss(model, step: int = 0) -> float:
    """Hugging Face's own loss (labels shifted inside) on the batch `tpc run --seed 0` draws."""
    from tpc.executors.training.batches import RandomTokens

    tokens = RandomTokens(0, BATCH, SEQ, 256).get(step)
    with torch.no_grad():
        return float(type(model).__mro__[1].forward(model, input_ids=tokens, labels=tokens).loss)


def test_init_from_a_hugging_face_directory_gives_its_own_loss(hf, tmp_path):
    from safetensors import safe_open

    plan, d, pretrained = hf
    with safe_open(str(d / "pretrained" / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # Hugging Face stores the tie under its first name only
    out = tmp_path / "m.jsonl"
    assert run(plan, out, "--steps", "1", "--init-from", str(d / "pretrained")) == 0
    assert metrics(out)[0]["loss"] == pytest.approx(hf_loss(pretrained), rel=1e-5)


def test_export_of_a_hugging_face_model_is_a_directory_from_pretrained_loads(hf, tmp_path):
    from transformers import AutoModelForCausalLM

    from tpc.executors.training.export import export_state_dict

    plan, d, _ = hf
    ck = tmp_path / "ck"
    assert run(plan, tmp_path / "m.jsonl", "--steps", "2", "--init-from", str(d / "pretrained"),
               "--checkpoint-dir", str(ck)) == 0
    assert main(["export", str(ck), "-o", str(tmp_path / "out")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    sd, _ = export_state_dict(ck)
    assert all(torch.equal(loaded.state_dict()[k], sd[k]) for k in sd)
    x = torch.randint(0, 256, (2, 9))
    mine = load_model(HF_CONFIG)
    mine.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, mine(x))
    # and it starts a run where the checkpoint would
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert run(plan, a, "--steps", "1", "--init-from", str(tmp_path / "out")) == 0
    assert run(plan, b, "--steps", "1", "--init-from", str(ck)) == 0
    assert metrics(a)[0]["loss"] == metrics(b)[0]["loss"]


def test_an_interrupted_hugging_face_export_leaves_nothing_behind(hf, tmp_path, monkeypatch, capsys):
    """A full disk (or Ctrl-C) in the middle of `save_pretrained`: no half-written model
    directory at -o, nothing left beside it, and the error names -o."""
    import errno

    from transformers import PreTrainedModel

    plan, d, _ = hf
    ck = tmp_path / "ck"
    assert run(plan, tmp_path / "m.jsonl", "--steps", "1", "--init-from", str(d / "pretrained"),
               "--checkpoint-dir", str(ck)) == 0
    real = PreTrainedModel.save_pretrained

    def full_disk(self, folder, *a, **kw):
        real(self, folder, *a, **kw)  # writes its files, then the disk fills
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    out = tmp_path / "exports" / "out"
    out.parent.mkdir()
    assert main(["export", str(ck), "-o", str(out)]) != 0
    assert not out.exists() and list(out.parent.iterdir()) == []
    assert str(out) in capsys.readouterr().err


def test_hf_export_needs_a_hugging_face_model(exported, tmp_path, capsys):
    _, _, d, _ = exported
    assert main(["export", str(d / "ck"), "-o", str(tmp_path / "dir")]) == 1
    err = capsys.readouterr().err
    assert "--format: error: -o" in err and "needs a Hugging Face model" in err and "builds a GPT" in err


# ------------------------------------------------------------------------------ refusals


def refused(plan: str, tmp_path: Path, capsys, source, *extra: str) -> str:
    """Run from `source`: refused (status 1), nothing trained or saved; the error text."""
    out, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    assert run(plan, out, "--steps", "2", "--init-from", str(source), "--checkpoint-dir", str(ck), *extra) == 1
    assert not out.exists() and not ck.exists()
    return capsys.readouterr().err


def test_a_state_dict_with_missing_and_extra_names_is_refused_listing_them(exported, tmp_path, capsys):
    plan, _, d, _ = exported
    sd = torch.load(d / "gpt.pt", weights_only=True)
    sd = {("_orig_mod." + k if "h.1." in k else k): v for k, v in sd.items()}  # torch.compile's prefix
    torch.save(sd, tmp_path / "renamed.pt")
    err = refused(plan, tmp_path, capsys, tmp_path / "renamed.pt")
    assert f"--init-from: error: {tmp_path / 'renamed.pt'}: the state_dict's names do not match the model: " in err
    assert "missing from the file (12): transformer.h.1.ln_1.weight, transformer.h.1.ln_1.bias, " in err
    assert "not in the model (12): _orig_mod.transformer.h.1.attn.c_attn.bias, " in err
    assert "... (8 more)" in err and "hint:" in err


@pytest.mark.parametrize("kind", ["int64", "bool"])
def test_integer_or_boolean_weights_are_refused_not_cast(exported, tmp_path, capsys, kind):
    """A parameter stored as integers or booleans has the right names and shapes, and cast to
    float it would train from garbage: refused, naming it, before any training."""
    plan, _, d, _ = exported
    sd = torch.load(d / "gpt.pt", weights_only=True)
    name = next(k for k in sd if k.endswith("ln_f.weight"))
    sd[name] = sd[name].to(getattr(torch, kind))
    torch.save(sd, tmp_path / "ints.pt")
    err = refused(plan, tmp_path, capsys, tmp_path / "ints.pt")
    assert "holds parameters that are not floating-point numbers (1): " + f"{name}: {kind}" in err, err


def test_a_pickle_that_is_not_weights_only_is_refused(exported, tmp_path, capsys):
    import argparse

    plan, _, d, _ = exported
    torch.save({"model": torch.load(d / "gpt.pt", weights_only=True), "args": argparse.Namespace(lr=0.1)},
               tmp_path / "ckpt.pt")  # a training script's checkpoint, its arguments pickled
    err = refused(plan, tmp_path, capsys, tmp_path / "ckpt.pt")
    assert f"{tmp_path / 'ckpt.pt'}: not a weights-only file: loading it would run code (Unsupported global: " \
           "GLOBAL argparse.Namespace)" in err
    torch.save({"model": torch.load(d / "gpt.pt", weights_only=True)}, tmp_path / "nested.pt")
    assert "not a flat state_dict of tensors ('model': dict)" in refused(plan, tmp_path, capsys, tmp_path / "nested.pt")


def test_truncated_files_are_refused(exported, tmp_path, capsys):
    import shutil

    plan, data, d, _ = exported
    whole = (d / "gpt.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[: len(whole) // 2])
    err = refused(plan, tmp_path, capsys, tmp_path / "cut.safetensors")
    assert f"{tmp_path / 'cut.safetensors'}: not a readable safetensors file (" in err and "truncated" in err
    whole = (d / "gpt.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(whole[: len(whole) // 2])
    assert f"{tmp_path / 'cut.pt'}: not a readable torch.save file" in refused(plan, tmp_path, capsys, tmp_path / "cut.pt")

    # a checkpoint whose shard file was cut short: --resume refuses it, naming the directory
    ck = tmp_path / "ck2"
    shutil.copytree(d / "ck", ck)
    shard = sorted((ck / "step_000004").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    out = tmp_path / "r.jsonl"
    assert run(plan, out, "--steps", "5", "--data", data, "--checkpoint-dir", str(ck), "--resume") == 1
    err = capsys.readouterr().err
    assert f"{ck / 'step_000004'}: corrupt checkpoint: the data file {shard.name} is 100 bytes, its entries need " in err
    assert "(truncated)" in err and "--resume continues from" in err
    assert not out.exists() and not (ck / "step_000005").exists()


def test_weights_of_another_model_are_refused(exported, hf, tmp_path, capsys):
    plan, _, d, _ = exported
    _, hf_dir, _ = hf
    err = refused(plan, tmp_path, capsys, hf_dir / "pretrained")
    assert f"{hf_dir / 'pretrained' / 'model.safetensors'}: the Hugging Face model directory's names do not match" in err
    assert "missing from the file (" in err and "transformer.wte.weight (or lm_head.weight)" in err
    assert "not in the model (" in err and "model.embed_tokens.weight" in err
    # a directory that is neither kind
    (tmp_path / "empty").mkdir()
    assert "neither a Hugging Face model directory" in refused(plan, tmp_path, capsys, tmp_path / "empty")


def test_init_from_with_resume_starts_once_then_resumes(exported, tmp_path):
    """`--init-from W --resume` (a job script that may be restarted): from W while the checkpoint
    directory is empty, from the newest checkpoint afterwards: the same losses as one run."""
    plan, data, d, _ = exported
    common = ["--data", data, "--init-from", str(d / "gpt.pt"), "--checkpoint-dir", str(tmp_path / "ck"), "--resume"]
    assert run(plan, tmp_path / "m.jsonl", "--steps", "2", *common) == 0
    assert run(plan, tmp_path / "m.jsonl", "--steps", "4", *common) == 0
    assert run(plan, tmp_path / "whole.jsonl", "--steps", "4", "--data", data, "--init-from", str(d / "gpt.pt")) == 0
    assert [r["loss"] for r in metrics(tmp_path / "m.jsonl")] == [r["loss"] for r in metrics(tmp_path / "whole.jsonl")]


def test_sample_reads_a_safetensors_export_as_the_pt(exported, capsys):
    _, _, d, _ = exported
    args = ["--prompt", "de", "--tokens", "8", "--temperature", "0"]
    assert main(["sample", str(d / "gpt.pt"), *args]) == 0
    from_pt = capsys.readouterr().out
    assert main(["sample", str(d / "gpt.safetensors"), *args]) == 0
    assert capsys.readouterr().out == from_pt and from_pt.startswith("de")


def test_a_hugging_face_config_that_differs_is_said(hf, tmp_path, capsys):
    import shutil

    plan, d, _ = hf
    other = tmp_path / "other"
    shutil.copytree(d / "pretrained", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert main(["run", "--interpret", plan, "--init-from", str(other), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"initialised from {other / 'model.safetensors'} (Hugging Face model directory)" in out
    assert "note: its config.json differs from the model's: rms_norm_eps 1e-05 (model: 1e-06)" in out
