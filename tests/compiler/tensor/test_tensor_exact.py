"""Tensor parallelism found from the captured graph, T = 2 ranks on threads: the loss and every
parameter's gradient (gathered back to its full shape) equal plain autograd on the unsharded
model, for models nobody on this project wrote: nanoGPT, a torchtitan-style Llama (GQA), and
Hugging Face's Llama (GQA) and GPT-2 (fused QKV through Conv1D, tied head)."""

from __future__ import annotations

import pytest
import torch

from tests.compiler.frontend.harness import batch, tiny_model
from tests.compiler.frontend.hf_models import VOCAB, assert_grads_match, hf_model
from tests.compiler.tensor.tp_harness import sliced_step, whole_step
from tpc.compiler.frontend import SlicedModel
from tpc.compiler.tensor import collectives
from tpc.executors.oracle import reference, relative_error

L = 16
MODELS = ["nanogpt", "llama", "hf-llama", "hf-gpt2"]


def _model(name):
    if name.startswith("hf-"):
        return hf_model(name[3:], "sdpa"), VOCAB
    m = tiny_model(name)
    return m, int(m(torch.zeros(1, 1, dtype=torch.long)).shape[-1])


@pytest.fixture(scope="module", params=MODELS)
def case(request):
    m, vocab = _model(request.param)
    sm = SlicedModel.from_model(m, seq_len=L, vocab=vocab, check_slices=None)
    ids, targets = batch(vocab, 2, L)
    return request.param, m, sm, ids, targets, reference(m, ids, targets)


def test_whole_model_matches_autograd(case):
    name, m, sm, ids, targets, ref = case
    losses, grads = whole_step(sm, ids, targets, 2)
    for loss in losses:
        assert relative_error(torch.tensor(loss), torch.tensor(ref.loss)) <= 1e-5
    assert_grads_match(grads, {n: g for n, g in ref.grads.items() if n not in ref.unused})


def test_sliced_pipeline_matches_autograd(case):
    """Two pipeline stages, three unequal slices (one of one token), each tensor rank's cache
    holding its own key/value heads."""
    name, m, sm, ids, targets, ref = case
    ranges = [(0, 2), (2, sm.num_units)]
    losses, grads, stages = sliced_step(sm, ranges, ids, targets, [5, 1, 10], 2)
    for loss in losses:
        assert relative_error(torch.tensor(loss), torch.tensor(ref.loss)) <= 1e-5
    assert_grads_match(grads, {n: g for n, g in ref.grads.items() if n not in ref.unused})
    # the caches are the rank's heads: dimension 1 (heads) of every cached tensor halved
    plain = sm.stage_module(*ranges[1])
    for full, half in zip(plain.kv_shapes, stages[0][1].kv_shapes):
        assert half(2)[1] * 2 == full(2)[1] and half(2)[0] == full(2)[0]


def test_the_split_is_megatrons(case):
    """What was split: q/k/v (or the fused QKV) and MLP-in column-parallel, attention-out and
    MLP-out row-parallel, the token embedding and the head by vocabulary; norms replicated."""
    name, m, sm, ids, targets, ref = case
    from tests.compiler.tensor.tp_harness import rank_stages

    stage = rank_stages(sm, [(0, sm.num_units)], 2)[0][0]
    split = {n: (s.dim, s.segments) for n, s in stage.shards.items() if not s.replicated}
    full = dict(m.named_parameters())
    for n, p in full.items():
        if p.dim() == 1 and n not in split:
            continue
        if "norm" in n or "ln" in n.split(".")[-2]:
            assert n not in split, n
    rows = [n for n, (d, _) in split.items() if full[n].dim() == 2]
    assert len(rows) >= 4 * 2 + 1, sorted(split)  # per layer at least q/k/v-or-fused, out, in, down
    if name == "hf-gpt2":  # Conv1D weights are (in, out); the fused QKV is three segments
        assert split["transformer.h.0.attn.c_attn.weight"] == (1, (32, 32, 32))
        assert split["transformer.h.0.attn.c_proj.weight"] == (0, (32,))
        assert split["transformer.wte.weight"] == (0, (VOCAB,))
    if name == "hf-llama":
        for p in ("q_proj", "k_proj", "v_proj"):
            assert split[f"model.layers.0.self_attn.{p}.weight"][0] == 0
        assert split["model.layers.0.self_attn.o_proj.weight"] == (1, (32,))
        assert split["model.layers.0.mlp.gate_proj.weight"][0] == 0
        assert split["model.layers.0.mlp.up_proj.weight"][0] == 0
        assert split["model.layers.0.mlp.down_proj.weight"] == (1, (64,))
        assert split["lm_head.weight"] == (0, (VOCAB,))


def test_the_front_ends_rewritten_graph_splits_as_its_stage_graph(case):
    """find_split reads the SlicedModel's rewritten graph (logits out, no loss) as it reads the
    stage graph (loss appended): the same parameters, cut the same way."""
    from tpc.compiler.frontend.stage import build_stage_graph
    from tpc.compiler.tensor import find_split

    name, m, sm, ids, targets, ref = case
    ctx = sm.context
    stage_graph, _ = build_stage_graph(ctx, 0, sm.num_units, True)
    a = find_split(stage_graph, 2, ctx.param_names, ctx.model_file)
    b = find_split(ctx.graph, 2, ctx.param_names, ctx.model_file)
    assert a.split_params() == b.split_params() and a.split_params()
    assert b.head is not None and len(b.embeddings) == 1


def _gqa_model(kind):
    if kind == "llama-kv2-T4":  # 4 query heads, 2 key/value heads, 4 ranks: one key/value head per 2 ranks
        torch.manual_seed(0)
        return tiny_model("llama"), 256, 4
    return hf_model("llama", "sdpa", num_key_value_heads=1), VOCAB, 2  # multi-query attention


@pytest.mark.parametrize("kind", ["llama-kv2-T4", "hf-llama-mqa-T2"])
def test_fewer_key_value_heads_than_ranks_are_replicated_and_exact(kind):
    """T does not divide the key/value heads but they divide T: every rank computes them whole
    and caches the one head its query heads read; loss and gradients still match autograd,
    whole and slice by slice."""
    m, vocab, degree = _gqa_model(kind)
    sm = SlicedModel.from_model(m, seq_len=L, vocab=vocab, check_slices=None)
    ids, targets = batch(vocab, 2, L)
    ref = reference(m, ids, targets)
    ranges = [(0, 2), (2, sm.num_units)]
    losses, grads, stages = sliced_step(sm, ranges, ids, targets, [5, 1, 10], degree)
    for loss in losses:
        assert relative_error(torch.tensor(loss), torch.tensor(ref.loss)) <= 1e-5
    assert_grads_match(grads, {n: g for n, g in ref.grads.items() if n not in ref.unused})
    plan = stages[0][1].plan
    assert plan.replicated_kv and all(s.replicated for n, s in stages[0][1].shards.items()
                                      if n.endswith(("k_proj.weight", "v_proj.weight", "wk.weight", "wv.weight")))
    assert all(shape(2)[1] == 1 for shape in stages[0][1].kv_shapes)
    heads = sorted({plan.kv_head(name, r) for name in plan.replicated_kv for r in range(degree)})
    assert heads == list(range(plan.replicated_kv[next(iter(plan.replicated_kv))][0]))


@pytest.mark.parametrize("family", ["phi3", "qwen3", "gpt_neox", "gemma", "opt", "qwen2", "mistral"])
def test_more_hugging_face_families_split_exactly(family):
    """Phi-3 (fused QKV cut by slices into unequal q, k, v segments; fused gate/up cut by chunk),
    Qwen3 (per-head q/k norms read inside the region), GPT-NeoX (partial rotary), Gemma, OPT
    (biases everywhere), Qwen2, Mistral: the whole model at T = 2 against autograd."""
    m = hf_model(family, "sdpa")
    sm = SlicedModel.from_model(m, seq_len=L, vocab=VOCAB, check_slices=None)
    ids, targets = batch(VOCAB, 2, L)
    ref = reference(m, ids, targets)
    losses, grads = whole_step(sm, ids, targets, 2)
    for loss in losses:
        assert relative_error(torch.tensor(loss), torch.tensor(ref.loss)) <= 1e-5
    assert_grads_match(grads, {n: g for n, g in ref.grads.items() if n not in ref.unused})


def test_the_loss_is_vocabulary_parallel_and_logits_leaving_a_stage_are_gathered(case):
    """The last stage computes its loss on logits split over the vocabulary; a stage without the
    loss returns the model's logits whole (all-gathered) on every rank."""
    from tests.compiler.tensor.tp_harness import on_threads
    from tpc.compiler.tensor import shard_stage, thread_groups

    name, m, sm, ids, targets, ref = case
    groups = thread_groups(2)
    with_loss = shard_stage(sm, 0, sm.num_units, 2, 0, groups[0])
    assert with_loss.plan.vocab_loss and "vocab_parallel_sum_token_loss" in with_loss.code
    stages = [shard_stage(sm, 0, sm.num_units, 2, r, groups[r], with_loss=False) for r in range(2)]
    assert "gather_from_region" in stages[0].code
    with torch.no_grad():
        want = m(ids)
        got = on_threads(2, lambda r: stages[r](ids, 0, stages[r].empty_kv(2))[0])
    for logits in got:
        assert relative_error(logits, getattr(want, "logits", want)) <= 1e-5


def test_the_embeddings_padding_row_and_every_rank_s_last_row_train_as_autograd_trains_them():
    """Hugging Face embeddings have a padding row (pad_token_id 0) that gets no gradient from the
    lookup. A vocabulary-parallel embedding keeps it on the rank that holds that row, and no
    other: the other rank's last row is an ordinary row (F.embedding would read a padding index
    of -1 as the last row). The batch holds the padding token and each rank's last token; the
    tied head gives every row a gradient of its own."""
    m = hf_model("llama", "sdpa", tie_word_embeddings=True)
    sm = SlicedModel.from_model(m, seq_len=L, vocab=VOCAB, check_slices=None)
    ids, targets = batch(VOCAB, 2, L)
    ids = ids.clone()
    ids[0, :3] = torch.tensor([0, VOCAB // 2 - 1, VOCAB - 1])
    ref = reference(m, ids, targets)
    losses, grads = whole_step(sm, ids, targets, 2)
    assert relative_error(torch.tensor(losses[0]), torch.tensor(ref.loss)) <= 1e-5
    assert_grads_match(grads, {n: g for n, g in ref.grads.items() if n not in ref.unused})


@pytest.mark.parametrize("name", ["nanogpt", "hf-gpt2", "hf-opt"])
def test_a_learned_position_table_is_split_by_columns_into_the_embeddings_sum(name):
    """`wte(ids) + wpe(pos)`: the position table is cut by its columns (each rank holds 1/T of
    it and of its gradient) and its lookup added to the rank's partial token lookup before the
    embedding's one all-reduce; the loss and every gradient still match autograd, sliced."""
    if name == "hf-opt":
        m, vocab = hf_model("opt", "sdpa"), VOCAB
    else:
        m, vocab = _model(name)
    sm = SlicedModel.from_model(m, seq_len=L, vocab=vocab, check_slices=None)
    ids, targets = batch(vocab, 2, L)
    ref = reference(m, ids, targets)
    ranges = [(0, 2), (2, sm.num_units)]
    losses, grads, stages = sliced_step(sm, ranges, ids, targets, [5, 1, 10], 2)
    first = stages[0][0]
    assert len(first.plan.folded) == 1
    table = next(n for n, s in first.shards.items() if s.dim == 1 and not s.replicated)
    assert table.endswith(("wpe.weight", "embed_positions.weight"))
    whole = dict(m.named_parameters())[table]
    assert [tuple(st[0].shards[table].take(whole, r).shape) for r, st in enumerate(stages)] == \
        [(whole.size(0), whole.size(1) // 2)] * 2
    # the embedding's one sum, after the add: the partial token lookup and the rank's columns
    targets_of = [n.target for n in first.graph.nodes]
    assert collectives.vocab_parallel_embedding not in targets_of
    assert targets_of.count(collectives.vocab_lookup) == targets_of.count(collectives.column_lookup) == 1
    assert any(n.target is collectives.reduce_from_region and n.args[0].target is torch.ops.aten.add.Tensor
               for n in first.graph.nodes)
    for loss in losses:
        assert relative_error(torch.tensor(loss), torch.tensor(ref.loss)) <= 1e-5
    assert_grads_match(grads, {n: g for n, g in ref.grads.items() if n not in ref.unused})
