"""Mixers along the sequence that are not causal, or that the sliced model cannot rebuild: each
factory must be refused naming the construct (op, module, line).

* `centred`: Conv1d(padding=1) of kernel 3, the same length out, token t reads t + 1;
* `lookahead`: the next token mixed in, F.pad(x[:, 1:], (0, 0, 0, 1));
* `replicate`: a convolution over the sequence padded by repeating its first token;
* `learned_bias`: a relative attention bias from a learned table (T5's, without buckets)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self, kind, vocab=64, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = Mixer(kind, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.mix(self.emb(ids)))


class Mixer(nn.Module):
    def __init__(self, kind, d):
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv1d(d, d, 3, padding=1 if kind == "centred" else 0)
        self.rel = nn.Embedding(64, 2)
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        if self.kind == "centred":
            return x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        if self.kind == "lookahead":
            return x + F.pad(x[:, 1:], (0, 0, 0, 1))
        if self.kind == "replicate":
            return x + self.conv(F.pad(x.transpose(1, 2), (2, 0), mode="replicate")).transpose(1, 2)
        B, T, C = x.shape
        q, k, v = (t.view(B, T, 2, -1).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        pos = torch.arange(T, device=x.device)
        dist = (pos[:, None] - pos[None, :]).clamp(min=0)
        bias = self.rel(dist).permute(2, 0, 1)  # (heads, T, T), learned
        att = (q @ k.transpose(-2, -1) + bias).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        return x + (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)


def centred():
    return Net("centred")


def lookahead():
    return Net("lookahead")


def replicate():
    return Net("replicate")


def learned_bias():
    return Net("learned_bias")
