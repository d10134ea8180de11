"""Attention over packed documents is priced by what the document kernel computes: the share
`attention_share` gives equals, entry for entry, the score blocks `runtime_ops.causal_attention`
runs for rows of equal documents; and the traced-graph cost model scales only attention by it."""

from __future__ import annotations

import numpy as np

from tpc.compiler.costmodel.documents import attention_share
from tpc.compiler.frontend.runtime_ops import document_slice


def kernel_entries(c: int, l: int, m: int, row: int) -> int:
    """Score entries the per-document kernel computes for the slice [c, c + l) of a row of
    documents of length m."""
    doc = document_slice(tuple(range(0, row, m)), c, l, "cpu")
    keys_before = doc.keys - doc.length
    return sum((q_hi - q_lo) * (keys_before + q_hi - k_lo) for q_lo, q_hi, k_lo in doc.segments)


def test_share_is_what_the_kernel_computes():
    row = 96
    for m in (1, 5, 16, 96):
        for c, l in [(0, 96), (0, 7), (13, 20), (16, 16), (40, 56), (95, 1)]:
            want = kernel_entries(c, l, m, row) / (l * (c + l))
            assert abs(float(attention_share(l, c, m)) - want) < 1e-12, (m, c, l)


def test_share_broadcasts_and_is_one_for_a_single_document():
    l, c = np.array([8, 16, 32]), np.array([[0], [64]])
    assert attention_share(l, c, 4).shape == (2, 3)
    assert np.allclose(attention_share(l, 0, 1024) * (l * l), l * l)


def test_graph_model_scales_attention_only():
    from tests.executors.real import model_file, traced
    from tpc.compiler.costmodel.devices import PRESETS as DEVICES
    from tpc.compiler.costmodel.graph import GraphCostModel, GraphCosts

    _, sliced, _ = traced(model_file("nanogpt"), 16)
    plain = GraphCostModel(DEVICES["h100"], GraphCosts.from_sliced(sliced), [(0, sliced.num_units)])
    docs = GraphCostModel(DEVICES["h100"], GraphCosts.from_sliced(sliced, document_length=4),
                          [(0, sliced.num_units)])
    fn = plain.costs.unit_fns[1]
    a = plain._unit_times(fn, 8, 8, 1)
    b = docs._unit_times(fn, 8, 8, 1)
    assert b[0] < a[0] and b[1] < a[1] and b[2:] == a[2:]  # less attention time, the same kernels
    same = docs._unit_times(fn, 4, 0, 1)
    assert same[:2] == plain._unit_times(fn, 4, 0, 1)[:2]  # a slice that is one document: unchanged
