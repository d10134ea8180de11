import torch.nn as nn
import torch.nn.functional as F

from _base import Tiny


class FusedQKV(Tiny):
    """q, k, v split off a fused projection with permute + unbind(0): the unbound axis is the
    size-3 one, not the sequence, so the model is sliceable."""

    def forward(self, ids):
        x = self.emb(ids)  # (B, T, C)
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # 3 x (B, heads, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(B, T, C))


def model() -> nn.Module:
    return FusedQKV()
