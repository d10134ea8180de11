"""A tiny causal LM that the bad-model fixtures change in one place each."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Tiny(nn.Module):
    def __init__(self, vocab=64, d=32, heads=2, causal=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, vocab)
        self.heads, self.causal = heads, causal

    def attend(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return x + y.transpose(1, 2).reshape(B, T, C)
