"""A tiny GPT written the way minGPT writes it (github.com/karpathy/minGPT, model.py), with the
three habits that break a reference built carelessly:

* each block's MLP is a lambda that captures the block's modules in a closure (`self.mlpf`), so
  `copy.deepcopy` of the model gives a copy whose MLP still runs the original's weights;
* the forward calls `.view` on its input ids, which fails on a non-contiguous view of a batch;
* a parameter the forward never uses (autograd gives it no gradient)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BLOCK, N_EMBD, N_HEAD, N_LAYER = 256, 32, 32, 2, 2


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        k = k.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        q = q.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        v = v.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(N_EMBD, 4 * N_EMBD), c_proj=nn.Linear(4 * N_EMBD, N_EMBD),
                                      act=nn.GELU()))
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))  # MLP forward, as minGPT writes it

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, N_EMBD), wpe=nn.Embedding(BLOCK, N_EMBD),
            h=nn.ModuleList([Block() for _ in range(N_LAYER)]), ln_f=nn.LayerNorm(N_EMBD)))
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.spare = nn.Parameter(torch.ones(N_EMBD))  # never used by forward

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        tok = self.transformer.wte(idx.view(b * t)).view(b, t, N_EMBD)  # views its input ids
        x = tok + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def model():
    return GPT()
