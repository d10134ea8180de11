"""An RWKV-style model: every block mixes in the previous token through RWKV's time shift,
`nn.ZeroPad2d((0, 0, 1, -1))` (pad one zero token in front, drop the last), with learned per
channel interpolation (RWKV-4's `time_mix_k`, `time_mix_r`). The channel mix is RWKV's; the time
mix here is causal attention over the shifted inputs (RWKV's own WKV recurrence is a scan along
the sequence, which token slices cannot cut)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class ChannelMix(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.time_mix_k = nn.Parameter(torch.rand(1, 1, d))
        self.time_mix_r = nn.Parameter(torch.rand(1, 1, d))
        self.key = nn.Linear(d, 4 * d, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        xx = self.time_shift(x)  # x[t - 1], zero at t = 0
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        k = torch.square(torch.relu(self.key(xk)))
        return torch.sigmoid(self.receptance(xr)) * self.value(k)


class ShiftedAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.time_mix = nn.Parameter(torch.rand(1, 1, d))
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        B, T, C = x.shape
        x = x * self.time_mix + self.time_shift(x) * (1 - self.time_mix)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.att, self.ffn = ShiftedAttention(d, heads), ChannelMix(d)

    def forward(self, x):
        x = x + self.att(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class RWKVLike(nn.Module):
    def __init__(self, vocab=64, d=32, heads=2, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln0 = nn.LayerNorm(d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_out = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.ln0(self.emb(idx))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_out(x))


def model() -> nn.Module:
    return RWKVLike()
