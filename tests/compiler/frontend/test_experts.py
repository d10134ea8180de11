"""Mixture-of-experts layers: the tokens grouped by expert (a sort), run through the experts and
put back into token order are token-local (`experts.py`). Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
GraniteMoE, dots1, DeepSeek-V3 and GPT-OSS from tiny configs (transformers' grouped-matmul experts) and a layer written by
hand (argsort, gathers, index_add_), 2 and 3 stages with equal, unequal and one-token slices:
loss and every gradient within 1e-5 of plain autograd. Capacity-limited routing and grouped rows
joined with token-ordered ones are refused at their line; the auxiliary load-balancing loss is
refused at its key in the config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tpc.compiler.frontend import SlicedModel, load_model
from tpc.compiler.frontend.experts import KIND
from tpc.ir.diagnostics import TpirError

from .harness import assert_sliced_exact
from .hf_models import VOCAB, config_dict, hf_model

MOE = Path(__file__).resolve().parent / "models" / "moe_routing.py"
SEQ, ROWS, MICROBATCHES = 16, 4, 2
SLICINGS = [[4, 4, 4, 4], [5, 2, 9], [1, 1, 1, 13]]


def _exact(model, sm, vocab, stage_counts=(2, 3)):
    assert_sliced_exact(model, sm, vocab, ROWS, SEQ, MICROBATCHES, SLICINGS, stages=stage_counts)


def _dispatches(sm) -> int:
    return sum(1 for n in sm.context.graph.nodes if n.meta.get("tpc_kind") == KIND and "sort" in str(n.target))


@pytest.mark.parametrize("family,impl,layers", [
    ("mixtral", "sdpa", 2), ("qwen2_moe", "sdpa", 2), ("olmoe", "eager", 2), ("deepseek_v3_moe", "eager", 1),
    ("gpt_oss", "eager", 2), ("qwen3_moe", "sdpa", 2), ("granitemoe", "sdpa", 2), ("dots1", "sdpa", 2),
])
def test_mixture_of_experts_families_are_exact(family, impl, layers):
    pytest.importorskip("transformers")
    model = hf_model(family, impl)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    assert _dispatches(sm) == layers
    _exact(model, sm, VOCAB)


def test_a_hand_written_layer_grouped_by_argsort_and_put_back_by_index_add_is_exact():
    torch.manual_seed(0)
    model = load_model(str(MOE))
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=64)
    assert _dispatches(sm) == 1
    _exact(model, sm, 64, stage_counts=(1,))  # one unit: no numbered blocks to cut between


def _line(needle: str) -> int:
    return next(i for i, t in enumerate(MOE.read_text().splitlines(), 1) if needle in t)


@pytest.mark.parametrize("factory,needle,words", [
    ("capacity", "onehot.cumsum(dim=0)", "`cumsum` along the sequence axis"),
    ("leak", "rows = rows + flat.repeat_interleave", "joins the tokens grouped by expert with"),
])
def test_what_is_not_token_local_is_refused_at_its_line(factory, needle, words):
    torch.manual_seed(0)
    with pytest.raises(TpirError) as e:
        SlicedModel.from_model(load_model(str(MOE), factory), seq_len=SEQ, vocab=64)
    d = e.value.diagnostics[0]
    assert words in d.message and d.loc.line == _line(needle) and d.loc.file.endswith("moe_routing.py")


def test_the_auxiliary_loss_is_refused_at_its_key_in_the_config(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_dict("mixtral", output_router_logits=True), indent=1))
    with pytest.raises(TpirError) as e:
        load_model(str(path))
    d = e.value.diagnostics[0]
    assert "auxiliary load-balancing loss" in d.message and d.loc.file == str(path)
    assert '"output_router_logits"' in path.read_text().splitlines()[d.loc.line - 1]


def test_the_cost_model_prices_the_top_k_experts_of_each_token():
    """A grouped matmul is priced as its rows times one expert each: 2 x (tokens x top-k) x k x n."""
    pytest.importorskip("transformers")
    sm = SlicedModel.from_model(hf_model("mixtral", "sdpa"), seq_len=SEQ, vocab=VOCAB, check_slices=None)
    grouped = [n for n in sm.context.graph.nodes if "grouped_mm" in str(n.target)]
    assert len(grouped) == 4
    cost = grouped[0].meta["tpc_cost"]
    l, b = sm.context.seq_sym, sm.context.batch_sym
    x = grouped[0].args[0].meta["val"]
    out = grouped[0].meta["val"]
    assert cost.kind == "matmul"
    assert cost.flops.subs({l: 16, b: 1}) == 2 * (16 * 2) * x.shape[-1] * out.shape[-1]
