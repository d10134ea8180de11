"""Written-out attention (nanoGPT's form: q @ k^T, masked_fill(-inf), softmax, @ v) under a mask
buffer that is not necessarily causal: the front end must compile it exactly or refuse it.

`Masked(kind, width)` builds the (block x block) buffer of keys each query sees:
  band      keys q - width < k <= q (a sliding window of `width` tokens)
  chunk     causal within chunks of `width` tokens (chunked local attention)
  document  causal within documents, a new one starting at token `width`
  sink      a window of `width` tokens plus the first token (attention sinks)
  strided   causal, every `width`-th key only (plus the query's own)
  future    causal plus `width` tokens ahead
`Windowed(width)` builds the same band in forward from positions, as Hugging Face's
masking_utils does, and passes it to scaled_dot_product_attention."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def keep(kind: str, width: int, n: int) -> torch.Tensor:
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    causal = k <= q
    if kind == "band":
        return causal & (k > q - width)
    if kind == "chunk":
        return causal & (q // width == k // width)
    if kind == "document":
        return causal & ((q >= width) == (k >= width))
    if kind == "sink":
        return causal & ((k > q - width) | (k == 0))
    if kind == "strided":
        return causal & (((q - k) % width == 0) | (k == q))
    if kind == "future":
        return k <= q + width
    raise ValueError(kind)


class Block(nn.Module):
    def __init__(self, d, heads, block, kind, width):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads = heads
        self.register_buffer("mask", keep(kind, width, block).view(1, 1, block, block).float())

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))  # a causal-looking mask
        att = F.softmax(att, dim=-1)
        return x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Masked(nn.Module):
    def __init__(self, kind="band", width=4, vocab=64, d=32, heads=2, layers=2, block=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, block, kind, width) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class WindowedBlock(nn.Module):
    def __init__(self, d, heads, width):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads, self.width = heads, width

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        pos = torch.arange(T, device=x.device)
        sees = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.width)  # (T, T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=sees)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, C))


class Windowed(nn.Module):
    def __init__(self, width=4, vocab=64, d=32, heads=2, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(WindowedBlock(d, heads, width) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def model() -> nn.Module:
    return Masked()
