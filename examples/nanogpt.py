"""nanoGPT with its non-flash attention path, for `tpc compile examples/nanogpt.py`.

The attention is written out by hand, as nanoGPT does without flash attention: a registered
causal-mask buffer sliced by the sequence length, `q @ k.transpose`, `masked_fill(-inf)`,
softmax, `@ v`. The front end recognises this pattern as causal attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class NanoGPTConfig:
    vocab_size: int = 256  # bytes: no tokenizer needed for the examples
    block_size: int = 256  # size of the causal-mask buffer and the position table
    n_layer: int = 4  # deep enough to cut into 2-4 pipeline stages
    n_head: int = 4  # head size n_embd / n_head = 32
    n_embd: int = 128  # residual stream width; trains on a CPU in minutes
    dropout: float = 0.0  # no dropout: sliced and unsliced runs compare exactly
    bias: bool = True  # biases in Linear and LayerNorm, as in GPT-2


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        # lower-triangular mask: query i may look at keys 0..i
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size))
        self.register_buffer("bias", mask.view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))  # (B, nh, T, T)
        att = F.softmax(att, dim=-1)  # (B, nh, T, T)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class NanoGPT(nn.Module):
    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, vocab)


def model(**overrides) -> NanoGPT:
    """The default nanoGPT; keyword arguments override NanoGPTConfig fields."""
    return NanoGPT(replace(NanoGPTConfig(), **overrides))
