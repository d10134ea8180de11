"""Mixture-of-experts layers written by hand, the ways they are usually written.

`model()`: top-k routing, tokens grouped by expert with `argsort`, each expert run on its rows,
put back with `index_add_` at the tokens' positions (token-local: exact when sliced).
`capacity()`: Switch-style routing limited by an expert's capacity: a token's place in its
expert's queue is the `cumsum` of the assignments over the whole sequence, and the tokens past
the capacity are dropped (refused: a slice ranks its tokens differently).
`leak()`: the grouped rows added to rows still in token order (refused)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from _base import Tiny


class Experts(nn.Module):
    def __init__(self, d, n=4, k=2, how="sorted"):
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.w1 = nn.Parameter(torch.randn(n, d, 2 * d) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(n, 2 * d, d) / (2 * d) ** 0.5)
        self.n, self.k, self.how = n, k, how

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        probs = self.router(flat).softmax(-1)
        if self.how == "capacity":
            top = probs.argmax(-1)
            onehot = F.one_hot(top, self.n).float()
            place = onehot.cumsum(dim=0) * onehot  # the token's place in its expert's queue
            keep = (place <= 2).any(-1, keepdim=True).float()  # capacity 2: later tokens dropped
            h = torch.einsum("tc,tcd->td", flat, self.w1[top]).relu()
            return (torch.einsum("td,tdc->tc", h, self.w2[top]) * keep).reshape(B, T, C)
        weight, expert = probs.topk(self.k, dim=-1)
        expert = expert.reshape(-1)
        perm = torch.argsort(expert)
        rows = flat[perm // self.k]
        if self.how == "leak":
            rows = rows + flat.repeat_interleave(self.k, dim=0)  # still in token order
        w1, w2 = self.w1[expert[perm]], self.w2[expert[perm]]
        out = torch.bmm(torch.bmm(rows[:, None], w1).relu(), w2)[:, 0] * weight.reshape(-1)[perm, None]
        y = torch.zeros_like(flat)
        y.index_add_(0, perm // self.k, out)
        return y.reshape(B, T, C)


class MoE(Tiny):
    def __init__(self, how="sorted"):
        super().__init__()
        self.moe = Experts(32, how=how)

    def forward(self, ids):
        x = self.attend(self.emb(ids))
        return self.head(x + self.moe(x))


def model() -> nn.Module:
    return MoE()


def capacity() -> nn.Module:
    return MoE("capacity")


def leak() -> nn.Module:
    return MoE("leak")
