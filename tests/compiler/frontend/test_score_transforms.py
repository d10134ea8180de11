"""Transforms of the attention scores before the softmax, sliced exactly over a cached prefix:
Gemma 2's logit soft-capping (`c * tanh(s / c)`), GPT-OSS's attention sinks (a learned logit
per head joined as one more key column, dropped after the softmax; its mixture-of-experts
layers with it) and XGLM's clamp of the
scores to the dtype's minimum (which changes no finite score). Each from its Hugging Face code,
2 and 3 stages with equal, unequal and one-token slices: loss and every gradient within 1e-5 of
plain autograd. What cannot be read so is refused at its line."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from tpc.compiler.frontend import SlicedModel
from tpc.ir.diagnostics import TpirError

from .harness import assert_sliced_exact
from .hf_models import VOCAB, hf_model

SEQ, ROWS, MICROBATCHES = 16, 4, 2
SLICINGS = [[4, 4, 4, 4], [5, 2, 9], [1, 1, 1, 13]]


def _exact(model, sm):
    assert_sliced_exact(model, sm, VOCAB, ROWS, SEQ, MICROBATCHES, SLICINGS)


@pytest.mark.parametrize("family,kwarg,windows", [
    ("gemma2", "softcap", [4, None]),
    ("gpt_oss", "sink", [4, None]),
    ("xglm", None, [None, None]),
])
def test_score_transforms_are_exact_over_the_cached_prefix(family, kwarg, windows):
    pytest.importorskip("transformers")
    model = hf_model(family, "eager")  # GPT-OSS with its experts (experts.py)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    assert [s.window for s in sm._sites] == windows
    kwargs = [s.node.kwargs for s in sm._sites]
    if kwarg == "softcap":
        assert all(k["softcap"] == model.config.attn_logit_softcapping for k in kwargs)
        assert all(math.isclose(k["scale"], model.config.query_pre_attn_scalar ** -0.5 / k["softcap"]) for k in kwargs)
    elif kwarg == "sink":
        assert all(isinstance(k["sink"], torch.fx.Node) for k in kwargs)
    else:  # the clamp is dropped: plain SDPA
        assert all("softcap" not in k and "sink" not in k for k in kwargs)
    _exact(model, sm)


class _Scores(nn.Module):
    """A one-layer LM whose attention scores pass through `how` before the softmax."""

    def __init__(self, how, d=16, vocab=32):
        super().__init__()
        self.emb, self.qkv, self.head = nn.Embedding(vocab, d), nn.Linear(d, 3 * d), nn.Linear(d, vocab)
        self.sink = nn.Parameter(torch.zeros(2))
        self.how = how

    def forward(self, ids):
        x = self.emb(ids)
        B, T, C = x.shape
        q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in self.qkv(x).split(C, -1))
        s = q @ k.transpose(-2, -1) / math.sqrt(C // 2)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        if self.how == "mask-inside-tanh":
            s = 5.0 * torch.tanh(s.masked_fill(~mask, float("-inf")) / 5.0)  # refused here
        else:
            s = s.masked_fill(~mask, float("-inf"))
            s = torch.cat([s, s[..., :1] * 0.5], dim=-1)  # refused here: a column made from the scores
        p = s.softmax(-1)[..., :T]
        return self.head(x + (p @ v).transpose(1, 2).reshape(B, T, C))


def _marked_lines():
    with open(__file__) as f:
        return [i for i, text in enumerate(f, 1) if text.rstrip().endswith("# refused" + " here")
                or "# refused" + " here:" in text]


@pytest.mark.parametrize("how,which,words", [
    ("mask-inside-tanh", 0, "inside their soft-capping `tanh`"),
    ("joined-column", 1, "a column joined onto the attention scores (`cat`"),
])
def test_what_cannot_be_read_is_refused_at_its_line(how, which, words):
    line = _marked_lines()[which]
    with pytest.raises(TpirError) as e:
        SlicedModel.from_model(_Scores(how), seq_len=8, vocab=32)
    d = e.value.diagnostics[0]
    assert words in d.message and d.loc.file == __file__ and d.loc.line == line, (d.message, d.loc)
