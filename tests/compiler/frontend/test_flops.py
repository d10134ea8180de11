"""Cost records of the sliced graph (compiler/frontend/flops.py): FLOPs against the textbook
counts of a GPT block and a Llama block, their scaling in the slice length and the context,
the kernels and the backward rules, and the records kept in node.meta."""

from __future__ import annotations

import numpy as np
import pytest
import sympy
import torch

from tpc.compiler.frontend import SlicedModel
from tpc.compiler.frontend.calls import op_name
from tpc.compiler.frontend.flops import CTX, FREE
from tpc.compiler.frontend.model_file import import_model_file

from .harness import EXAMPLES

H, HEADS, V = 64, 4, 64  # tiny GPT: width, heads, vocabulary
POINTS = [(1, 0, 1), (8, 0, 2), (16, 24, 3), (5, 7, 1), (32, 96, 4)]  # (l, c, b)


@pytest.fixture(scope="module")
def gpt() -> SlicedModel:
    torch.manual_seed(0)
    m = import_model_file(str(EXAMPLES / "gpt.py")).model(n_layer=2, n_embd=H, n_head=HEADS,
                                                          vocab_size=V, block_size=128)
    return SlicedModel.from_model(m, seq_len=128, vocab=V)


LLAMA = dict(n_layer=2, dim=64, n_head=4, n_kv_head=2, hidden_mult=3, max_seq_len=128, vocab_size=V)


@pytest.fixture(scope="module")
def llama() -> SlicedModel:
    torch.manual_seed(0)
    m = import_model_file(str(EXAMPLES / "llama.py")).model(**LLAMA)
    return SlicedModel.from_model(m, seq_len=128, vocab=V)


def _block(sm, l, c, b):
    return sm.unit_costs(l, c, b)[1]


def test_gpt_block_flops_are_the_textbook_count(gpt):
    """Linears 24*b*l*h^2 (QKV 6, projection 2, MLP 8 + 8) plus their biases (3h + h + 4h + h per
    token); attention Q K^T and P V over the c + l keys: 4*b*l*(c+l)*h."""
    for l, c, b in POINTS:
        cost = _block(gpt, l, c, b)
        assert cost.fwd["matmul"].flops == 24 * b * l * H * H + 9 * b * l * H
        assert cost.fwd["attention"].flops == 4 * b * l * (c + l) * H
        textbook = 24 * b * l * H * H + 4 * b * l * (c + l) * H
        total = cost.total("fwd").flops
        # the rest is biases, layer norms, GELU and residual adds: a few FLOPs per element
        assert textbook <= total <= 1.05 * textbook


def test_gpt_flops_scale_with_slice_and_context(gpt):
    fn = gpt.unit_cost_fns()[1]
    mm = lambda l, c, b: fn(l, c, b).fwd["matmul"].flops  # noqa: E731
    at = lambda l, c, b: fn(l, c, b).fwd["attention"].flops  # noqa: E731
    assert mm(64, 0, 2) == 2 * mm(32, 0, 2) == 4 * mm(16, 0, 2)  # linear in l
    assert mm(16, 0, 4) == 2 * mm(16, 0, 2)  # linear in b
    assert mm(16, 100, 2) == mm(16, 0, 2)  # the linears do not see the context
    # attention: linear in c at fixed l, the slope 4*b*l*h per cached token
    a0, a1, a2 = at(16, 0, 2), at(16, 40, 2), at(16, 80, 2)
    assert a2 - a1 == a1 - a0 == 40 * 4 * 2 * 16 * H


def test_llama_block_flops_match_its_own_formula(llama):
    """SwiGLU (w1, w3: d -> f, w2: f -> d), GQA (wk, wv: d -> kv*hd), no biases; attention over
    all query heads after the repeat."""
    d, nh, kv, f = 64, 4, 2, 3 * 64
    hd = d // nh
    for l, c, b in POINTS:
        cost = _block(llama, l, c, b)
        assert cost.fwd["matmul"].flops == 2 * b * l * (2 * d * d + 2 * d * kv * hd + 3 * d * f)
        assert cost.fwd["attention"].flops == 4 * b * l * (c + l) * nh * hd
    # the cache holds the un-repeated key/value heads: 2 layers x (k + v) x kv heads x hd
    assert llama.unit_kv_elements == [0, 2 * kv * hd, 2 * kv * hd, 0]


def test_kernels_views_are_free_and_prefix_copies_counted(gpt, llama):
    # GPT block: 4 linears; SDPA (+ 2 concatenations of cache and slice when there is a
    # cache); 2 layer norms, GELU, 2 residual adds. Splits, head views and dropout(p=0) are free.
    first, later = _block(gpt, 8, 0, 1), _block(gpt, 8, 8, 1)
    assert (first.fwd["matmul"].kernels, first.fwd["attention"].kernels, first.fwd["memory"].kernels) == (4, 1, 5)
    assert later.fwd["attention"].kernels == 3
    # Llama: GQA repeats keys and values (2 kernels) after the cache
    assert _block(llama, 8, 0, 1).fwd["attention"].kernels == 3
    assert _block(llama, 8, 8, 1).fwd["attention"].kernels == 5
    kinds = {op_name(n): n.meta["tpc_cost"].kind for n in gpt._graph.nodes if n.op == "call_function"}
    assert kinds["transpose"] == kinds["view"] == kinds["split"] == "free"
    assert kinds["linear"] == "matmul" and kinds["layer_norm"] == kinds["gelu"] == "memory"


def test_backward_rules(gpt):
    for l, c, b in POINTS:
        cost = _block(gpt, l, c, b)
        for k in ("matmul", "attention", "memory"):
            assert cost.bwd[k].flops == 2 * cost.fwd[k].flops
        # input and weight gradient per linear, plus the weight gradient added into .grad
        # (weight and bias): 4 * (2 + 2)
        assert cost.bwd["matmul"].kernels == 16
        assert cost.bwd["attention"].kernels == 2 * cost.fwd["attention"].kernels


def test_head_unit_and_loss(gpt):
    l, c, b = 16, 0, 2
    head = gpt.unit_costs(l, c, b)[-1]
    assert head.fwd["matmul"].flops == 2 * b * l * H * V  # the LM head, no bias
    # final layer norm, then the loss at 4-byte floats: log-softmax and the summed NLL
    assert head.fwd["memory"].kernels == 1 + 2
    assert gpt.unit_costs(l, c, b, float_bytes=2)[-1].fwd["memory"].kernels == 1 + 3  # + cast to float32


def test_records_are_symbolic_and_kept_in_stage_graphs(gpt):
    linear = next(n for n in gpt._graph.nodes if n.op == "call_function" and op_name(n) == "linear")
    rec = linear.meta["tpc_cost"]
    b, t = gpt._batch_sym, gpt._seq_sym
    assert sympy.expand(rec.flops - (2 * b * t * H * 3 * H + b * t * 3 * H)) == 0
    attn = next(n for n in gpt._graph.nodes if n.meta.get("tpc_kind") == "attention")
    assert CTX in attn.meta["tpc_cost"].flops.free_symbols
    assert all("tpc_cost" in n.meta for n in gpt._graph.nodes)
    stage = gpt.stage_module(1, 2)
    copied = [n for n in stage.graph.nodes if op_name(n) == "linear"]
    assert copied and all(n.meta["tpc_cost"].kind == "matmul" for n in copied)
    assert FREE.flops == 0


def test_lambdified_functions_take_arrays(gpt):
    fn = gpt.unit_cost_fns()[1]
    l = np.array([1, 8, 64])[:, None]
    c = np.array([0, 16])[None, :]
    cost = fn(l, c, 2)
    assert cost.fwd["attention"].flops.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            one = fn(int(l[i, 0]), int(c[0, j]), 2)
            assert cost.fwd["attention"].bytes[i, j] == one.fwd["attention"].bytes
            assert cost.stash[i, j] == one.stash
    # identical blocks share one lambdified function
    fns = gpt.unit_cost_fns()
    assert fns[1].signature == fns[2].signature and fns[1].label != fns[2].label
