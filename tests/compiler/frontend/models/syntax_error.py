import torch.nn as nn


def model():
    return nn.Linear(4, 4
