import torch.nn as nn

from _base import Tiny


class Cumulative(Tiny):
    def forward(self, ids):
        x = self.emb(ids).cumsum(dim=1)  # running sum over tokens
        return self.head(self.attend(x))


def model() -> nn.Module:
    return Cumulative()
