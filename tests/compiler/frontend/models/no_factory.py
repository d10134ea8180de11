import torch.nn as nn


class Net(nn.Module):
    def forward(self, ids):
        return ids


def build():
    return Net()
