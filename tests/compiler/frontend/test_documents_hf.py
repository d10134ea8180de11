"""Stage graphs over packed documents (`documents.py`) for Hugging Face decoders whose positions
or masks take other paths: learned positions (GPT-2, OPT's from the attention mask), ALiBi
(BLOOM's `slope * k` on (batch * heads) scores, MPT's table), a sliding window (Starcoder2).
The whole model as one stage, sliced, against each document run alone through the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from tpc.compiler.frontend import SlicedModel  # noqa: E402

from .hf_models import assert_grads_match, hf_model  # noqa: E402

EOS, L = 2, 16


def _rows(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, L), generator=g)
    targets = torch.randint(3, vocab, (2, L), generator=g)
    ids[0, [3, 4, 9]] = EOS  # documents 0..3, 4, 5..9, 10..15
    ids[1, [7]] = EOS  # a window of 4 reaches across the boundary at 8
    return ids, targets, ((0, 4, 5, 10), (0, 8))


@pytest.mark.parametrize("family,impl", [("gpt2", "sdpa"), ("opt", "sdpa"), ("bloom", "eager"), ("mpt", "eager"),
                                         ("starcoder2", "sdpa")])
def test_each_document_as_if_alone(family, impl):
    model = hf_model(family, impl)
    ids, targets, starts = _rows(128)
    masked = targets.masked_fill(ids == EOS, -100)
    params = [(n, p) for n, p in model.named_parameters()]
    total = 0
    for r, row in enumerate(starts):
        for a, b in zip(row, (*row[1:], L)):
            logits = model(ids[r:r + 1, a:b])
            total = total + F.cross_entropy(logits[0].float(), masked[r, a:b], reduction="sum")
    ref = dict(zip((n for n, _ in params), torch.autograd.grad(total, [p for _, p in params])))
    sliced = SlicedModel.from_model(model, seq_len=L, vocab=128, check_slices=None)
    stage = sliced.stage_module(0, sliced.num_units, documents=True)
    prefix, off, loss = stage.empty_kv(2), 0, 0
    for n in (5, 3, 8):
        y, kv = stage(ids[:, off:off + n], off, prefix, masked[:, off:off + n], documents=starts)
        prefix = [torch.cat([p, k], dim=d) for p, k, d in zip(prefix, kv, stage.kv_dims)]
        loss, off = loss + y, off + n
    assert abs(float(loss) - float(total)) <= 1e-5 * abs(float(total))
    got = dict(zip((n for n, _ in stage.named_parameters()),
                   torch.autograd.grad(loss, [p for _, p in stage.named_parameters()])))
    assert_grads_match(got, {n: ref[n] for n in got})
