"""Positions built as models written elsewhere build them: a rotary table computed under
@torch.no_grad() (exported as a grad-mode region) and positions that start at 1 (an arange the
front end cannot shift, so it is computed at full length and cut)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Rotary(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    @torch.no_grad()
    def forward(self, x):
        pos = torch.arange(x.size(1), device=x.device).float()
        freqs = pos[:, None] * self.inv_freq[None, :]  # (T, dim/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def rotate(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class Net(nn.Module):
    def __init__(self, vocab=64, d=32, heads=2, block=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block + 1, d)
        self.rotary = Rotary(d // heads)
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, vocab)
        self.gain = nn.Parameter(torch.full((d,), 0.5))  # read under no_grad: it gets no gradient
        self.heads = heads

    @torch.no_grad()
    def frozen_scale(self):
        return 1.0 + self.gain

    def forward(self, ids):
        B, T = ids.shape
        x = self.emb(ids) + self.pos(torch.arange(1, T + 1, device=ids.device))  # positions from 1
        x = x * self.frozen_scale()
        q, k, v = self.qkv(x).split(x.size(-1), dim=2)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        cos, sin = self.rotary(x)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(B, T, -1))


def model() -> nn.Module:
    return Net()
