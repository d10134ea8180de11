"""Models larger than a host: the compile builds the model without weights, and each rank builds
only its stages' parameters, with the values the plain model gets from the same seed
(compiler/frontend/weightless.py; the unit-by-unit self-check: unit_check.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.compiler.frontend.hf_models import CONFIGS, VOCAB, _IDS, _LAYERS
from tests.executors.real import real_plan
from tpc.compiler.frontend import SlicedModel, load_model
from tpc.compiler.frontend.weightless import build_holding, build_weightless
from tpc.executors.plan_model import load_rank_model, rank_parameter_names
from tpc.executors.pipeline import PlanSet

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def hf_config(tmp_path, family: str) -> str:
    c = dict(CONFIGS[family], vocab_size=VOCAB, **_IDS)
    for k, v in _LAYERS.items():
        c.setdefault(k, v)
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(c))
    return str(path)


@pytest.mark.parametrize("source", ["gpt.py", "llama.py", "llama", "gpt2", "opt"])
def test_the_same_seed_gives_the_same_weights_built_whole_or_in_part(source, tmp_path):
    pytest.importorskip("transformers")
    path = str(EXAMPLES / source) if source.endswith(".py") else hf_config(tmp_path, source)
    torch.manual_seed(5)
    whole = dict(load_model(path).named_parameters())
    after_whole = torch.rand(3)  # the generator ends where the whole build leaves it
    _, index = build_weightless(path)
    names = sorted(index)
    for part in (names[::3], names[1::2], [names[-1]]):
        model = build_holding(path, "model", 5, part, index)
        assert torch.equal(torch.rand(3), after_whole)
        got = dict(model.named_parameters())
        for n in names:
            if n in part:
                assert got[n].device.type == "cpu" and torch.equal(got[n], whole[n]), n
            else:
                assert got[n].is_meta, n


def test_compile_materialises_no_parameter(tmp_path):
    """`tpc compile`'s model holds no parameter storage: every parameter is on the meta device
    from the moment it is registered, through the trace and after the self-check."""
    model, _ = build_weightless(str(EXAMPLES / "gpt.py"))
    assert all(p.is_meta for p in model.parameters())
    sliced = SlicedModel.from_model(model, seq_len=16, vocab=None, check_slices=None)
    assert sliced.vocab == 256
    done = sliced.check_slicings([[1, 7, 8], [8, 8]])
    assert done.units == [0, 1, 5] and done.length == 16  # embeddings, one block (all six are the same code), final norm + head
    assert all(p.is_meta for p in model.parameters())


def test_a_rank_holds_only_its_stages_parameters():
    plan = real_plan("gpt", stages=3, microbatches=2, slices="8,8", schedule="seq1f1b")
    model = load_model(plan.header.model.path)
    sliced = SlicedModel.from_model(model, seq_len=16, vocab=plan.header.shape.vocab, check_slices=None)
    plans = PlanSet.single(plan)
    every = set(dict(model.named_parameters()))
    held = []
    for rank in range(3):
        names = rank_parameter_names(plans, {16: sliced}, rank)
        m = load_rank_model(plan, 0, names)
        real = {n for n, p in m.named_parameters() if not p.is_meta}
        assert real == names and names < every
        held.append(names)
    assert set().union(*held) == every
    assert "transformer.wte.weight" in held[0] and "transformer.wte.weight" in held[2]  # the tie's two ends
    assert not held[0] & held[1] - {"transformer.wte.weight"}


def test_init_from_a_sharded_directory_reads_only_the_ranks_bytes(tmp_path, monkeypatch):
    """A sharded Hugging Face directory: each rank's engine reads, through safe_open, exactly the
    bytes of its own parameters (counted), never a whole shard."""
    pytest.importorskip("transformers")
    import safetensors

    from tests.executors.real import fresh_model  # noqa: F401 - the model files' harness
    from tpc.executors.engine import RankEngine, stage_factory_from_model
    from tpc.executors.training import init_from, weight_files

    config = hf_config(tmp_path, "llama")
    torch.manual_seed(3)
    pretrained = load_model(config)
    pretrained.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 2
    plan = real_plan("hf", path=config, stages=2, microbatches=2, slices="8,8", schedule="seq1f1b")
    total = sum(p.numel() * 4 for p in pretrained.parameters())
    read = {}

    real_open = safetensors.safe_open

    class Counting:
        def __init__(self, *a, **k):
            self.handle = real_open(*a, **k)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            t = self.inner.get_tensor(name)
            read[name] = t.numel() * t.element_size()
            return t

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    assert weight_files  # reads safe_open from the safetensors module when it reads
    for rank in range(2):
        read.clear()
        model = load_model(config)
        sliced = SlicedModel.from_model(model, seq_len=16, vocab=VOCAB, check_slices=None)
        engine = RankEngine(plan, rank, 0, transport=None, stage_factory=stage_factory_from_model(sliced, model),
                            hidden_size=sliced.hidden_size)
        init_from.init_engines([engine], tmp_path / "hf", init_from.ModelNames.of(model))
        mine = {n: p for n, p in engine.named_parameters}
        assert sum(read.values()) == sum(p.numel() * 4 for p in mine.values()) < total
        assert set(read) <= set(mine) | {"lm_head.weight"}
        want = dict(pretrained.named_parameters())
        assert all(torch.equal(p, want[n]) for n, p in mine.items())


def test_a_rank_whose_weights_cannot_fit_is_refused_with_its_bytes(tmp_path, capsys):
    from tpc.cli.main import main

    out = tmp_path / "p.tpir"
    args = ["compile", str(EXAMPLES / "gpt.py"), "-o", str(out), "--stages", "2", "--seq-len", "16", "--batch", "2",
            "--slices", "2", "-q"]
    assert main([*args, "--memory-per-rank", "2MiB"]) == 1
    err = capsys.readouterr().err
    assert "exceed --memory-per-rank 2" in err and "rank 0 " in err and "rank 1 " in err
    assert "one unit alone needs" in err and not out.exists()
    assert main([*args, "--memory-per-rank", "1GiB"]) == 0


@pytest.mark.parametrize("how", ["causal", "row mask", "broadcast mask", "gqa"])
def test_the_reference_attention_by_query_rows_equals_one_call(how, monkeypatch):
    """The unit check's reference computes attention a block of query rows at a time (its scores
    bounded at heads x rows x L); the result is the one call's."""
    from tpc.compiler.frontend import unit_check

    monkeypatch.setattr(unit_check, "_ROWS", 5)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 13, 8, generator=g) for _ in range(3))
    kw: dict = {}
    if how == "causal":
        kw = dict(is_causal=True)
    elif how == "row mask":
        kw = dict(attn_mask=torch.randn(2, 1, 13, 13, generator=g))
    elif how == "broadcast mask":
        kw = dict(attn_mask=torch.randn(1, 13, generator=g))
    else:
        k, v = k[:, :2], v[:, :2]
        kw = dict(is_causal=True, enable_gqa=True)
    want = torch.ops.aten.scaled_dot_product_attention.default(q, k, v, **kw)
    got = unit_check._sdpa_by_query_rows(q, k, v, **kw)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    unmasked = {n: x for n, x in kw.items() if n not in ("is_causal", "attn_mask")}
    assert not torch.allclose(got, torch.ops.aten.scaled_dot_product_attention.default(q, k, v, **unmasked))


def test_the_unit_check_finds_the_first_token_over_slice_by_slice():
    from tpc.compiler.frontend.unit_check import _first_token_over

    ref = torch.zeros(1, 10, 3)
    outs = [torch.zeros(1, 4, 3), torch.zeros(1, 6, 3)]
    outs[1][0, 3, 2] = 1.0  # token 4 + 3
    assert _first_token_over(iter([o.clone() for o in outs]), ref, 0.5) == 7
    assert _first_token_over(iter([torch.zeros(1, 4, 3), torch.zeros(1, 6, 3)]), ref, 0.5) is None


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_family_checks_unit_by_unit(family, tmp_path):
    """The unit-by-unit self-check of a model built without weights accepts every family the
    front end takes (constants the model's code makes, such as GPT-Neo's mask value, included),
    at the plan's length and at a shorter one (`scaled_slicing`); a family the front end refuses
    is refused alike with and without weights. (The whole-model check of the same families:
    test_hf_families.py.)"""
    pytest.importorskip("transformers")
    from tpc.compiler.frontend.sliced import _iter_sliced
    from tpc.compiler.frontend.unit_check import check_units
    from tpc.ir.diagnostics import TpirError

    path = hf_config(tmp_path, family)
    try:
        weightless = SlicedModel.from_model(build_weightless(path)[0], seq_len=16, vocab=None, check_slices=None)
    except TpirError as e:
        with pytest.raises(TpirError) as whole:
            SlicedModel.from_model(load_model(path), seq_len=16, vocab=None, check_slices=None)
        assert str(whole.value).splitlines()[0] == str(e).splitlines()[0]
        return

    def refuse(token, lens, node):
        raise AssertionError(f"token {token} differs with slices {lens} at {node}")

    assert check_units(weightless, [[5, 2, 9]], _iter_sliced, refuse).length == 16
    assert check_units(weightless, [[5, 2, 9]], _iter_sliced, refuse, length=7).length == 7


def test_the_unit_check_runs_at_a_length_its_budget_affords(monkeypatch):
    """Beyond `CHECK_FLOPS` the distinct units are checked at the longest shorter length that
    fits (the plan's slices scaled to it), never under twice the slice count."""
    from tpc.compiler.frontend import unit_check

    model, _ = build_weightless(str(EXAMPLES / "gpt.py"))
    sliced = SlicedModel.from_model(model, seq_len=64, vocab=None, check_slices=None)
    slicings = [[16, 16, 16, 16]]
    units = unit_check.distinct_units(sliced)
    full = 2 * sum(float(sliced.unit_costs(64, 0, 1)[u].total("fwd").flops) for u in units)
    assert unit_check.check_length(sliced, units, slicings, budget=full) == 64
    half = unit_check.check_length(sliced, units, slicings, budget=full / 2)
    assert 8 < half < 64
    at = 2 * sum(float(sliced.unit_costs(half, 0, 1)[u].total("fwd").flops) for u in units)
    above = 2 * sum(float(sliced.unit_costs(half + 1, 0, 1)[u].total("fwd").flops) for u in units)
    assert at <= full / 2 < above
    assert unit_check.check_length(sliced, units, slicings, budget=1.0) == 8
    monkeypatch.setattr(unit_check, "CHECK_FLOPS", full / 2)
    done = sliced.check_slicings(slicings)
    assert done.length == half and done.units == units
    scaled = unit_check.scaled_slicing([16, 16, 16, 16], half)
    assert len(scaled) == 4 and sum(scaled) == half and max(scaled) - min(scaled) <= 1


def test_scaled_slicings_keep_the_count_and_the_fractions():
    from tpc.compiler.frontend.unit_check import scaled_slicing

    assert scaled_slicing([1024] * 4, 676) == [169] * 4
    assert scaled_slicing([1, 7, 8], 8) == [1, 3, 4]  # a slice keeps at least one token
    assert scaled_slicing([1, 7, 8], 2) == [1, 1]  # no more slices than tokens
    assert scaled_slicing([5, 5, 5], 3) == [1, 1, 1]
    assert scaled_slicing([3, 9], 12) == [3, 9]
