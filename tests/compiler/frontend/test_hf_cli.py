"""`tpc compile path/to/config.json` (a Hugging Face configuration, no wrapper) and
`tpc run --interpret --verify-grads` of the plan, under gpipe, 1f1b, terapipe, seq1f1b and
zb-h1, and under the schedules that put several chunks on a rank (interleaved, looped-bfs,
seq-interleaved, zbv, dualpipev): the plan's gradients match plain autograd, the header records
the file and its hash like a model file.
A file without `attn_implementation` gets transformers' default (eager for BLOOM's ALiBi)."""

from __future__ import annotations

import hashlib
import json

import pytest

pytest.importorskip("transformers")

from tpc.cli.main import main  # noqa: E402
from tpc.compiler.frontend import load_model  # noqa: E402
from tpc.ir.diagnostics import TpirError  # noqa: E402
from tpc.ir.parse import parse  # noqa: E402

from .hf_models import config_dict  # noqa: E402

CASES = [
    # family, attention, extra settings, schedule, stages, micro-batches, slices
    ("llama", "eager", {}, "gpipe", 2, 2, "5,3,8"),
    ("mistral", "sdpa", {"sliding_window": 5}, "1f1b", 3, 2, "4"),
    # a split backward (backward-input, then backward-weight) through a windowed cache
    ("mistral", "sdpa", {"sliding_window": 5}, "zb-h1", 2, 2, "3,5,8"),
    ("qwen2", "sdpa", {}, "terapipe", 2, 1, "1,7,8"),
    ("gpt2", "eager", {}, "seq1f1b", 2, 2, "3"),
    # the key bias's true gradient is zero (softmax cancels it): both sides hold rounding
    # residues, which --verify-grads must not divide by each other (executors/oracle.py)
    ("opt", "sdpa", {}, "seq1f1b", 2, 2, "3"),
    # ALiBi; no attn_implementation, as BLOOM's config.json on the hub: transformers' eager
    ("bloom", None, {}, "1f1b", 2, 2, "1,7,8"),
    # keys filled into new_empty by copy_ (DeepSeek-V3's latent attention): a plan that trains
    ("deepseek_v3", "eager", {}, "1f1b", 2, 2, "1,7,8"),
]


# several chunks per rank: family, attention, extra settings, schedule, stages, ranks, micro-batches, slices
CHUNKED = [
    ("llama", "sdpa", {"num_hidden_layers": 4}, "interleaved", 4, 2, 2, "5,3,8"),
    ("qwen2", "eager", {"num_hidden_layers": 4}, "looped-bfs", 4, 2, 2, "4"),
    ("mistral", "sdpa", {"num_hidden_layers": 4, "sliding_window": 5}, "seq-interleaved", 4, 2, 2, "3,5,8"),
    ("gpt2", "sdpa", {"n_layer": 4}, "zbv", 4, 2, 2, "1,7,8"),
    ("gemma", "eager", {"num_hidden_layers": 4}, "dualpipev", 4, 2, 4, "8"),
]


@pytest.fixture
def no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("family,impl,extra,schedule,stages,mbs,slices", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
def test_config_json_compiles_and_runs_exactly(tmp_path, capsys, no_torchrun, family, impl, extra, schedule,
                                               stages, mbs, slices):
    config = tmp_path / "config.json"
    chosen = {"attn_implementation": impl} if impl else {}
    config.write_text(json.dumps(config_dict(family, **chosen, **extra), indent=2))
    plan = tmp_path / "plan.tpir"
    assert main(["compile", str(config), "-o", str(plan), "--stages", str(stages), "--microbatches", str(mbs),
                 "--seq-len", "16", "--batch", "4", "--slices", slices, "--schedule", schedule]) == 0
    header = parse(plan.read_text(), file=str(plan)).header
    assert header.model.path == str(config)
    assert header.model.sha256 == hashlib.sha256(config.read_bytes()).hexdigest()
    capsys.readouterr()
    assert main(["run", "--interpret", str(plan), "--verify-grads"]) == 0
    out = capsys.readouterr().out
    assert "verify-grads:" in out and ": ok" in out


@pytest.mark.parametrize("family,impl,extra,schedule,stages,ranks,mbs,slices", CHUNKED,
                         ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CHUNKED])
def test_config_json_runs_exactly_with_several_chunks_per_rank(tmp_path, capsys, no_torchrun, family, impl, extra,
                                                               schedule, stages, ranks, mbs, slices):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(config_dict(family, attn_implementation=impl, **extra), indent=2))
    plan = tmp_path / "plan.tpir"
    assert main(["compile", str(config), "-o", str(plan), "--stages", str(stages), "--ranks", str(ranks),
                 "--microbatches", str(mbs), "--seq-len", "16", "--batch", "4", "--slices", slices,
                 "--schedule", schedule]) == 0
    header = parse(plan.read_text(), file=str(plan)).header
    assert header.mesh.pipe == ranks and len(header.stages) == stages
    capsys.readouterr()
    assert main(["run", "--interpret", str(plan), "--verify-grads"]) == 0
    out = capsys.readouterr().out
    assert "verify-grads:" in out and ": ok" in out


def test_a_config_json_model_keeps_hugging_faces_names(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(config_dict("llama", attn_implementation="eager", torch_dtype="bfloat16")))
    model = load_model(str(config))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config._attn_implementation == "eager"
    names = dict(model.named_parameters())
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert all(p.dtype.is_floating_point and p.dtype.itemsize == 4 for p in names.values())  # float32
    import torch

    logits = model(torch.zeros(2, 5, dtype=torch.long))
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 5, 128)


@pytest.mark.parametrize("text,words", [
    ("{\"model_type\": ", "not valid JSON"),
    ("{\"hidden_size\": 32}", "no \"model_type\""),
    ("{\"model_type\": \"no-such-model\"}", "cannot read this configuration"),
])
def test_a_bad_config_json_is_a_located_error(tmp_path, text, words):
    config = tmp_path / "config.json"
    config.write_text(text)
    with pytest.raises(TpirError) as info:
        load_model(str(config))
    d = info.value.diagnostics[0]
    assert words in d.message and d.loc.file == str(config) and d.hint


# Chimera (two pipelines over weight replicas) on untied Hugging Face decoders: family,
# attention, extra settings, stages (= ranks), micro-batches, slices
CHIMERA = [
    ("llama", "sdpa", {"num_hidden_layers": 4}, 4, 4, "5,3,8"),
    ("qwen2", "eager", {"num_hidden_layers": 2}, 2, 2, "1"),
    ("mistral", "sdpa", {"num_hidden_layers": 4, "sliding_window": 5}, 4, 4, "3"),
]


@pytest.mark.parametrize("family,impl,extra,stages,mbs,slices", CHIMERA, ids=[c[0] for c in CHIMERA])
def test_config_json_runs_exactly_under_chimera(tmp_path, capsys, no_torchrun, family, impl, extra, stages,
                                                mbs, slices):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(config_dict(family, attn_implementation=impl, **extra), indent=2))
    plan = tmp_path / "plan.tpir"
    assert main(["compile", str(config), "-o", str(plan), "--stages", str(stages), "--microbatches", str(mbs),
                 "--seq-len", "16", "--batch", str(2 * mbs), "--slices", slices, "--schedule", "chimera"]) == 0
    header = parse(plan.read_text(), file=str(plan)).header
    assert header.replicas == 2 and [st.ranks for st in header.stages] == [(s, stages - 1 - s) for s in range(stages)]
    capsys.readouterr()
    assert main(["run", "--interpret", str(plan), "--verify-grads"]) == 0
    out = capsys.readouterr().out
    assert "verify-grads:" in out and ": ok" in out


def test_chimera_runs_a_tied_hugging_face_model_exactly(tmp_path, capsys, no_torchrun):
    """GPT-2 ties its head to its embedding (stages 0 and 3, both on ranks 0 and 3 under Chimera):
    the tie reduced once over both replicas of both stages, `tpc run --verify-grads` exact."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(config_dict("gpt2", n_layer=4), indent=2))
    plan = tmp_path / "plan.tpir"
    assert main(["compile", str(config), "-o", str(plan), "--stages", "4", "--microbatches", "4",
                 "--seq-len", "16", "--batch", "8", "--slices", "2", "--schedule", "chimera"]) == 0
    header = parse(plan.read_text(), file=str(plan)).header
    assert header.replicas == 2 and [t.stages for t in header.ties] == [(0, 3)]
    capsys.readouterr()
    assert main(["run", "--interpret", str(plan), "--verify-grads"]) == 0
    out = capsys.readouterr().out
    assert "verify-grads:" in out and ": ok" in out
