import json
from pathlib import Path

import pytest
import torch

from tests.executors.training.models.tiny_gpt import model as tiny_model
from tests.executors.training.test_checkpoint import _shards, _split
from tpc.cli.main import main
from tpc.compiler.frontend.model_file import file_sha256
from tpc.executors.training.checkpoint import run_meta, save_checkpoint
from tpc.executors.training.export import export_state_dict
from tpc.executors.training.generate import generate, load_for_sampling
from tpc.executors.training.param_groups import build_optimizer
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Header, MeshLine, Microbatch, ModelLine, ScheduleLine, ShapeLine, Stage, UnitsLine

MODEL = Path(__file__).resolve().parent / "models" / "tiny_gpt.py"
X = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))


def _header(model_path=MODEL):
    return Header(
        model=ModelLine(str(model_path), file_sha256(str(model_path)), "model"),
        shape=ShapeLine(batch=2, seq=8, vocab=256), mesh=MeshLine(pipe=2, data=1), schedule=ScheduleLine("gpipe"),
        units=UnitsLine(4), stages=(Stage(0, 0, (0, 2)), Stage(1, 1, (2, 4))),
        microbatches=(Microbatch(0, 2, ((0, 8),)),))


def _train_and_save(root, steps=2):
    """Train the tiny model split over two 'ranks' and checkpoint it; returns the trained model."""
    torch.manual_seed(0)
    net = tiny_model()
    ranks = _split(net)
    opts = [build_optimizer("adamw", r, 5e-2, 0.1) for r in ranks]
    for _ in range(steps):
        net(X).square().mean().backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
    save_checkpoint(root, steps, _shards(ranks, opts, steps), run_meta(_header(), "cd" * 32, "adamw"))
    return net


def test_run_meta_records_what_export_and_resume_need():
    meta = run_meta(_header(), "cd" * 32, "adamw")
    assert meta["model_path"] == str(MODEL) and meta["factory"] == "model" and meta["seq"] == 8
    assert meta["sha256"] == file_sha256(str(MODEL)) and meta["optimizer"] == "adamw"
    assert meta["plan_sha256"] == "cd" * 32 and meta["mesh"] == {"pipe": 2, "data": 1}
    assert meta["plan"] == {"mesh": "2x1", "stages": "0:2 2:4", "schedule": "gpipe", "micro-batches": "1 of 2 rows",
                            "slices": "8", "seq": "8"}


def test_export_loads_strictly_and_gives_the_trained_logits(tmp_path):
    trained = _train_and_save(tmp_path / "ck")
    out = tmp_path / "model.pt"
    assert main(["export", str(tmp_path / "ck"), "-o", str(out)]) == 0
    sd = torch.load(out, weights_only=True)
    fresh = tiny_model()
    assert list(sd) == list(fresh.state_dict())  # same keys, same order, buffers included
    assert sd["wte.weight"] is sd["lm_head.weight"]  # a tie is one tensor under both names
    fresh.load_state_dict(sd, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(X), trained(X))
    side = json.loads(Path(f"{out}.json").read_text())
    assert side["step"] == 2 and side["model_path"] == str(MODEL)


def test_export_of_a_checkpoint_from_another_model_is_refused(tmp_path):
    _train_and_save(tmp_path / "ck")
    meta_path = tmp_path / "ck" / "step_000002" / "tpc.json"
    meta = json.loads(meta_path.read_text())
    other = tmp_path / "other.py"
    other.write_text(MODEL.read_text().replace("n_embd: int = 16", "n_embd: int = 32"))
    meta_path.write_text(json.dumps({**meta, "model_path": str(other), "sha256": file_sha256(str(other))}))
    with pytest.raises(TpirError, match=r"does not fit the model file.*shapes differ: wte.weight: checkpoint \[256, 16\], model \[256, 32\];.*more") as e:
        export_state_dict(tmp_path / "ck")
    assert "hint:" in str(e.value)
    other.unlink()
    with pytest.raises(TpirError, match="model file the checkpoint was trained from is gone"):
        export_state_dict(tmp_path / "ck")


def _manual_greedy(net, ids, n, context):
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(net(torch.tensor([ids[-context:]]))[0, -1, :256].argmax()))
    return ids


def test_greedy_picks_the_argmax_and_context_is_cropped(tmp_path):
    trained = _train_and_save(tmp_path / "ck")
    model, meta = load_for_sampling(tmp_path / "ck")
    lengths = []
    model.register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))
    prompt = list(b"hello")
    out = generate(model, prompt, 12, context=meta["seq"], temperature=0.0)
    assert out == _manual_greedy(trained, prompt, 12, 8)
    assert max(lengths) == 8 and lengths[0] == 5  # cropped to the training length, 8


def test_sampling_is_deterministic_for_a_seed_and_top_k_1_is_greedy(tmp_path):
    _train_and_save(tmp_path / "ck")
    model, _ = load_for_sampling(tmp_path / "ck")
    a = generate(model, [65], 20, context=8, temperature=1.0, seed=3)
    assert a == generate(model, [65], 20, context=8, temperature=1.0, seed=3)
    assert a != generate(model, [65], 20, context=8, temperature=1.0, seed=4)
    assert generate(model, [65], 6, context=8, temperature=1.0, top_k=1, seed=5) == \
        generate(model, [65], 6, context=8, temperature=0.0)
    assert all(0 <= t < 256 for t in a)


def test_sample_cli_from_checkpoint_and_from_export_print_the_same(tmp_path, capsys):
    _train_and_save(tmp_path / "ck")
    args = ["--prompt", "ab", "--tokens", "10", "--temperature", "0.9", "--top-k", "5", "--seed", "2"]
    assert main(["sample", str(tmp_path / "ck"), *args]) == 0
    from_ckpt = capsys.readouterr().out
    assert main(["export", str(tmp_path / "ck"), "-o", str(tmp_path / "m.pt")]) == 0
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "m.pt"), *args]) == 0
    from_pt = capsys.readouterr().out
    assert from_ckpt == from_pt and from_ckpt.startswith("ab")
    model, _ = load_for_sampling(tmp_path / "m.pt")
    ids = generate(model, list(b"ab"), 10, context=8, temperature=0.9, top_k=5, seed=2)
    assert from_ckpt == bytes(ids).decode("utf-8", errors="replace") + "\n"


def test_sample_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["sample", str(tmp_path / "missing")]) == 1
    assert "no such checkpoint" in capsys.readouterr().err
    torch.save(tiny_model().state_dict(), tmp_path / "bare.pt")
    assert main(["sample", str(tmp_path / "bare.pt")]) == 1
    assert "no model file known" in capsys.readouterr().err
    _train_and_save(tmp_path / "ck")
    assert main(["sample", str(tmp_path / "ck"), "--prompt", ""]) == 1
    assert "prompt is empty" in capsys.readouterr().err
