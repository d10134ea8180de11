"""A hybrid of short causal convolutions and attention (Mamba's, Hyena's and Griffin's short
filter beside causal attention), written as their reference code writes the convolution:

* Mamba: `nn.Conv1d(d, d, k, groups=d, padding=k - 1)`, then `[..., :seqlen]`;
* Hyena: `F.pad(x, (k - 1, 0))` and a valid depthwise `F.conv1d`.

`model(k)`: blocks alternate a gated Mamba-style mixer and causal attention; `hyena(k)` uses the
padded form instead; `long_kernel()` is `model(7)`."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class MambaConv(nn.Module):
    def __init__(self, d, k):
        super().__init__()
        self.in_proj = nn.Linear(d, 2 * d)
        self.conv1d = nn.Conv1d(d, d, kernel_size=k, groups=d, padding=k - 1)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x):
        seqlen = x.shape[1]
        xz = self.in_proj(x).transpose(1, 2)  # (B, 2d, L)
        x, z = xz.chunk(2, dim=1)
        x = F.silu(self.conv1d(x)[..., :seqlen])  # depthwise, causal: token t sees t - k + 1 .. t
        return self.out_proj((x * F.silu(z)).transpose(1, 2))


class HyenaConv(nn.Module):
    def __init__(self, d, k):
        super().__init__()
        self.in_proj = nn.Linear(d, 3 * d)
        self.short_filter = nn.Parameter(torch.randn(3 * d, 1, k) / k)
        self.out_proj = nn.Linear(d, d)
        self.k = k

    def forward(self, u):
        z = self.in_proj(u).transpose(1, 2)  # (B, 3d, L)
        z = F.conv1d(F.pad(z, (self.k - 1, 0)), self.short_filter, groups=z.size(1))
        x0, x1, v = z.chunk(3, dim=1)
        return self.out_proj((x0 * x1 * v).transpose(1, 2))


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))


class Layer(nn.Module):
    def __init__(self, d, mixer):
        super().__init__()
        self.norm, self.mixer = nn.RMSNorm(d), mixer

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class Hybrid(nn.Module):
    def __init__(self, vocab=64, d=32, k=4, heads=2, conv=MambaConv):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Layer(d, conv(d, k)), Layer(d, Attention(d, heads)), Layer(d, conv(d, k))])
        self.norm_f = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embedding(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))


def model(k: int = 4) -> nn.Module:
    return Hybrid(k=k)


def hyena(k: int = 3) -> nn.Module:
    return Hybrid(k=k, conv=HyenaConv)


def long_kernel() -> nn.Module:
    return model(7)
