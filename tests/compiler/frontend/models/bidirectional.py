import torch.nn as nn

from _base import Tiny


class Encoder(Tiny):
    def forward(self, ids):
        x = self.attend(self.emb(ids))  # bidirectional: causal=False below
        return self.head(x)


def model() -> nn.Module:
    return Encoder(causal=False)
