"""Chunked local attention (Llama 4's `attention_chunk_size`): a query sees the keys of its own
chunk up to itself. Sliced, a slice attends to its chunk's prefix only: the cache restarts at
chunk boundaries, so later slices read at most c - 1 cached tokens, and the memory model charges
a chunked layer min(T, c - 1 + longest slice) tokens. Llama 4 from a tiny config, 2 and 3
stages with equal, unequal (across chunk boundaries) and one-token slices: loss and every
gradient within 1e-5 of plain autograd."""

from __future__ import annotations

import json

import pytest
import torch

from tpc.compiler.frontend import SlicedModel, masks
from tpc.compiler.frontend import runtime_ops as ops

from .harness import assert_sliced_exact, batch, simulated_kv_peaks
from .hf_models import VOCAB, config_dict, hf_model

SEQ, ROWS, MICROBATCHES = 16, 4, 2
SLICINGS = [[4, 4, 4, 4], [5, 2, 9], [1, 1, 1, 13], [3, 6, 7]]


def test_a_chunked_mask_is_read_with_its_chunk_length():
    n, c = 16, 4
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert masks.classify((k <= q) & (k >= q - q % c)) == masks.Pattern("chunked", 4)
    assert masks.classify((k <= q) & (k >= q - q % c) & (k > q - 3)) is None  # chunked and banded: refused


@pytest.mark.parametrize("lens", [[4, 4, 4, 4], [5, 2, 9], [1, 1, 1, 13], [3, 6, 7]])
def test_the_chunked_op_equals_the_whole_sequence_for_any_cached_prefix(lens):
    """Slice by slice, with the whole prefix or only the last c - 1 tokens cached, the op gives
    the unsliced chunked attention's output."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, SEQ, 8, generator=g) for _ in range(3))
    pos = torch.arange(SEQ)
    sees = (pos[None, :] <= pos[:, None]) & (pos[None, :] // 4 == pos[:, None] // 4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=sees)
    for cut in (None, 3):
        off, outs = 0, []
        for ln in lens:
            kp, vp = k[:, :, :off], v[:, :, :off]
            if cut is not None:
                kp, vp = kp[:, :, max(0, off - cut):], vp[:, :, max(0, off - cut):]
            outs.append(ops.causal_attention(q[:, :, off:off + ln], k[:, :, off:off + ln], v[:, :, off:off + ln],
                                             kp, vp, chunk=4, offset=off))
            off += ln
        assert torch.allclose(torch.cat(outs, dim=2), ref, atol=1e-6)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_llama4_chunked_attention_is_exact(impl):
    pytest.importorskip("transformers")
    model = hf_model("llama4_text", impl)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    assert [s.window for s in sm._sites] == [4, None]  # the chunked layer's cache: 3 tokens kept
    assert sm._sites[0].node.kwargs["chunk"] == 4 and "window" not in sm._sites[0].node.kwargs
    assert_sliced_exact(model, sm, VOCAB, ROWS, SEQ, MICROBATCHES, SLICINGS)


def test_simulated_kv_memory_of_a_chunked_model_is_bounded_by_the_chunk(tmp_path):
    """tpc simulate's memory charges a chunked layer's cache min(T, c - 1 + longest slice)
    tokens, where a causal layer holds T (a chunk as long as the sequence is causal)."""
    pytest.importorskip("transformers")
    seq, slices, chunk = 64, 8, 8
    peaks = {}
    for name, c in (("chunked", chunk), ("full", seq)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config_dict("llama4_text", attention_chunk_size=c, no_rope_layers=[1, 1])))
        sm, peaks[name] = simulated_kv_peaks(path, seq, slices, VOCAB)
        assert [s.window for s in sm._sites] == ([chunk, chunk] if name == "chunked" else [None, None])
    held = min(seq, chunk - 1 + seq // slices)
    for chunked, full in zip(peaks["chunked"], peaks["full"]):
        assert chunked == pytest.approx(full * held / seq)
