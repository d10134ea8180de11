import torch.nn as nn

from _base import Tiny


class Branchy(Tiny):
    def forward(self, ids):
        x = self.emb(ids)
        if x.sum() > 0:  # control flow on tensor values
            x = x * 2
        return self.head(self.attend(x))


def model() -> nn.Module:
    return Branchy()
