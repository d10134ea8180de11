"""What tensor parallelism refuses, and how it says so: a degree that does not divide the heads,
the key/value heads or the vocabulary (naming the dimension), and an op that mixes the split
dimension (naming the parameter, the dimension, T and the model's line)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.compiler.frontend.harness import EXAMPLES, tiny_model
from tpc.compiler.frontend.model_file import import_model_file
from tpc.compiler.frontend import SlicedModel
from tpc.compiler.frontend.stage import build_stage_graph
from tpc.compiler.tensor import find_split
from tpc.ir.diagnostics import TpirError

L = 8


def _split(model, vocab, degree):
    sm = SlicedModel.from_model(model, seq_len=L, vocab=vocab, check_slices=None)
    graph, _ = build_stage_graph(sm.context, 0, sm.num_units, True)
    return find_split(graph, degree, sm.context.param_names, sm.context.model_file)


def _line_of(code: str) -> int:
    lines = open(__file__, encoding="utf-8").read().split("\n")
    return next(i for i, line in enumerate(lines, 1) if line.strip().startswith(code))


def _vocab(m):
    return int(m(torch.zeros(1, 1, dtype=torch.long)).shape[-1])


def test_a_degree_that_does_not_divide_the_heads_is_refused_naming_them():
    m = tiny_model("nanogpt")  # 2 heads of 16: the fused QKV's 32-wide segments divide by 4, the heads do not
    with pytest.raises(TpirError) as e:
        _split(m, _vocab(m), 4)
    text = str(e.value)
    assert "tensor degree 4" in text and "4 does not divide dimension 2 of the result (the heads" in text
    assert "of size 2" in text and "transformer.h.0.attn.c_attn.weight" in text
    assert "nanogpt.py:" in text  # the model's line that cuts q into heads


def test_key_value_heads_neither_divisible_by_the_degree_nor_dividing_it_are_refused():
    """6 query heads, 3 key/value heads, T = 2: T divides neither the key/value heads (no split)
    nor do they divide T (no replication with one head per rank)."""
    torch.manual_seed(0)
    m = import_model_file(str(EXAMPLES / "llama.py")).model(n_layer=1, dim=48, n_head=6, n_kv_head=3,
                                                           max_seq_len=16)
    with pytest.raises(TpirError) as e:
        _split(m, _vocab(m), 2)
    text = str(e.value)
    assert "2 does not divide dimension 2 of the result (the heads" in text and "of size 3" in text
    assert "attention.wk.weight" in text and "llama.py:" in text


def test_a_degree_that_does_not_divide_the_vocabulary_is_refused():
    m = tiny_model("nanogpt")
    vocab = _vocab(m)
    assert vocab % 3
    with pytest.raises(TpirError) as e:
        _split(m, vocab, 3)
    assert f"3 does not divide the vocabulary, of size {vocab}" in str(e.value) and "tensor degree 3" in str(e.value)


class NormedMLP(nn.Module):
    """An MLP that normalises its hidden activations over their whole width: the column-parallel
    output is mixed along the split dimension before the row-parallel projection."""

    def __init__(self, vocab=64, dim=16, hidden=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        h = F.gelu(self.up(x))
        h = F.layer_norm(h, (h.size(-1),))  # mixes the split dimension
        return self.head(x + self.down(h))


def test_an_op_that_mixes_the_split_dimension_is_refused_at_its_line():
    with pytest.raises(TpirError) as e:
        _split(NormedMLP(), 64, 2)
    text = str(e.value)
    assert "`up.weight`" in text and "dimension 2 (size 32)" in text and "tensor degree 2" in text
    assert "layer_norm" in text and f"test_tensor_refusals.py:{_line_of('h = F.layer_norm')}:" in text and "reduces (or normalises) over" in text


def test_degree_one_is_accepted_and_a_degree_below_one_is_a_value_error():
    m = tiny_model("nanogpt")
    plan = _split(m, _vocab(m), 1)
    assert plan.degree == 1
    with pytest.raises(ValueError):
        _split(m, _vocab(m), 0)


def test_dropout_under_tensor_parallelism_is_refused_and_evaluation_drops_it():
    from tpc.compiler.tensor import shard_stage, thread_groups

    torch.manual_seed(0)
    m = import_model_file(str(EXAMPLES / "nanogpt.py")).model(n_layer=1, n_embd=32, n_head=2, block_size=16,
                                                             dropout=0.1)
    with pytest.raises(TpirError) as e:
        _split(m, _vocab(m), 2)
    assert "dropout with p = 0.1" in str(e.value) and "nanogpt.py:" in str(e.value)
    sm = SlicedModel.from_model(m, seq_len=L, vocab=_vocab(m), check_slices=None)
    stage = shard_stage(sm, 0, sm.num_units, 2, 0, thread_groups(2)[0], evaluation=True)
    assert stage.plan.head is not None


def test_a_degree_that_does_not_divide_the_intermediate_size_is_refused():
    class OddMLP(NormedMLP):
        def forward(self, ids):
            x = self.emb(ids)
            return self.head(x + self.down(F.gelu(self.up(x))))

    with pytest.raises(TpirError) as e:
        _split(OddMLP(hidden=30), 64, 4)
    text = str(e.value)
    assert "4 does not divide the output size, of size 30" in text and "`up.weight`" in text
    assert f"test_tensor_refusals.py:{_line_of('return self.head(x + self.down(F.gelu(self.up(x))))')}:" in text
