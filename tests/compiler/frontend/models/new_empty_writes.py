"""A small GPT whose attention builds its keys as DeepSeek-V3's latent attention does: an
uninitialised tensor (`new_empty`) filled by copies into slices of it, a part without rotary
positions and a part with them (`key[..., :n].copy_(nope)`, `key[..., n:].copy_(rot)`), and a
value cast into a tensor of another dtype by `copy_` (`out.copy_(v)`, broadcast over heads)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d, heads, rot=4):
        super().__init__()
        self.heads, self.hd, self.rot = heads, d // heads, rot
        self.q, self.k_nope, self.k_rot = nn.Linear(d, d), nn.Linear(d, d - heads * rot), nn.Linear(d, rot)
        self.v, self.proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        nope = self.k_nope(x).view(B, T, self.heads, self.hd - self.rot).transpose(1, 2)
        rot = torch.tanh(self.k_rot(x)).view(B, 1, T, self.rot)  # shared by the heads, broadcast
        k = nope.new_empty(B, self.heads, T, self.hd)
        k[..., : self.hd - self.rot].copy_(nope)
        k[..., self.hd - self.rot:].copy_(rot)
        v = self.v(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, d=32, heads=2, layers=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.wte(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model() -> nn.Module:
    return GPT()
