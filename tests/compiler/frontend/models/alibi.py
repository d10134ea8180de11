"""A GPT with ALiBi instead of position embeddings, written the way the paper's reference code
and tutorials write it (Press et al., "Train Short, Test Long"): a per-head slope, a bias
-slope * (i - j) from arange over queries and keys, added to the scores with a causal mask.

`model()` writes the attention out (q @ k^T / sqrt(d) + bias, masked_fill(-inf), softmax, @ v);
`sdpa()` folds bias and causal mask into one float mask for scaled_dot_product_attention."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def get_slopes(n_heads: int) -> list[float]:
    """The geometric sequence of the paper: 2^(-8/n), 2^(-16/n), ... (n a power of two)."""
    start = 2 ** (-(2 ** -(math.log2(n_heads) - 3)))
    return [start * start ** i for i in range(n_heads)]


class AlibiAttention(nn.Module):
    def __init__(self, d_model, n_heads, fused):
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.n_heads, self.fused = n_heads, fused
        self.register_buffer("slopes", torch.tensor(get_slopes(n_heads)), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
        pos = torch.arange(T, device=x.device)
        distance = pos[:, None] - pos[None, :]  # (T, T): i - j
        bias = -self.slopes[:, None, None] * distance  # (H, T, T)
        if self.fused:
            mask = bias.masked_fill(distance < 0, float("-inf"))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            att = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1)) + bias
            att = att.masked_fill(distance < 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, fused):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = AlibiAttention(d_model, n_heads, fused)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class AlibiGPT(nn.Module):
    def __init__(self, vocab=64, d_model=32, n_heads=4, n_layers=2, fused=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)  # no position embedding: ALiBi is the position signal
        self.blocks = nn.ModuleList(Block(d_model, n_heads, fused) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def model() -> nn.Module:
    return AlibiGPT()


def sdpa() -> nn.Module:
    return AlibiGPT(fused=True)
