import torch.nn as nn


def model():
    width = 0
    return nn.Linear(32 // width, 4)
