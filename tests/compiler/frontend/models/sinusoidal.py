"""A decoder with the original Transformer's sinusoidal positions computed in forward, as
countless tutorials write it: a zero table filled column by column with in-place writes.

`model()` writes the even and odd columns through strided slices (`pe[:, 0::2] = sin(...)`);
`indexed()` through an index tensor (`pe[:, idx] = ...`, index_put) into an uninitialised table."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def sinusoidal(T: int, d: int, device) -> torch.Tensor:
    pe = torch.zeros(T, d, device=device)
    position = torch.arange(0, T, dtype=torch.float, device=device).unsqueeze(1)  # (T, 1)
    div_term = torch.exp(torch.arange(0, d, 2, device=device).float() * (-math.log(10000.0) / d))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe


def sinusoidal_indexed(T: int, d: int, device) -> torch.Tensor:
    pe = torch.empty(T, d, device=device)
    position = torch.arange(T, device=device).float()[:, None]
    even = torch.arange(0, d, 2, device=device)
    angle = position / 10000 ** (even / d)
    pe[:, even] = torch.sin(angle)
    pe[:, even + 1] = torch.cos(angle)
    return pe


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.ff(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, vocab=64, d=32, heads=2, layers=2, table=sinusoidal):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.out = nn.Linear(d, vocab)
        self.d, self.table = d, table

    def forward(self, ids):
        x = self.embed(ids) * math.sqrt(self.d)
        x += self.table(ids.size(1), self.d, ids.device)  # in place, as tutorials do
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def model() -> nn.Module:
    return Decoder()


def indexed() -> nn.Module:
    return Decoder(table=sinusoidal_indexed)
