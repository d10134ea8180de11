"""A causal convolution over the sequence (as in Hyena or Mamba's short convolution): it mixes
tokens through ops the token-mixing rules do not list (a pad and a conv1d), so only the numeric
self-check can see that slicing changes the model, and it must say where."""

import torch.nn as nn
import torch.nn.functional as F


class TokenConv(nn.Module):
    def __init__(self, vocab=64, d=16, k=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, k, groups=d)
        self.head = nn.Linear(d, vocab)
        self.k = k

    def forward(self, ids):
        x = self.emb(ids).transpose(1, 2)  # (B, C, T)
        x = self.conv(F.pad(x, (self.k - 1, 0)))  # each token sees the k - 1 before it
        return self.head(x.transpose(1, 2))


def model() -> nn.Module:
    return TokenConv()
