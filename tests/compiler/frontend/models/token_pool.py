"""A moving average over the sequence, centred on each token (a smoothing some models apply to
their inputs): `avg_pool1d` mixes tokens through an op the token-mixing rules do not list and
that is not a convolution, so only the numeric self-check can see that slicing changes the
model, and it must say where."""

import torch.nn as nn
import torch.nn.functional as F


class TokenPool(nn.Module):
    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids).transpose(1, 2)  # (B, C, T)
        x = F.avg_pool1d(x, 3, stride=1, padding=1, count_include_pad=False)  # tokens t - 1 .. t + 1
        return self.head(x.transpose(1, 2))


def model() -> nn.Module:
    return TokenPool()
