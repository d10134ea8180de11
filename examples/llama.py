"""A small Llama-style model for `tpc compile examples/llama.py`.

RMSNorm, rotary position embeddings (a complex `freqs_cis` buffer sliced by the sequence length),
SwiGLU feed-forward, grouped-query attention (fewer key/value heads, repeated to the query
heads), no weight tying.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256  # bytes: no tokenizer needed for the examples
    max_seq_len: int = 256  # length of the rotary table
    n_layer: int = 4  # deep enough to cut into 2-4 pipeline stages
    n_head: int = 4  # query heads; head size dim / n_head = 32
    n_kv_head: int = 2  # grouped-query attention: each key/value head serves 2 query heads
    dim: int = 128  # residual stream width; trains on a CPU in minutes
    hidden_mult: int = 3  # SwiGLU hidden width = hidden_mult * dim (Llama uses ~8/3)
    rope_theta: float = 10000.0  # rotary base, as in Llama
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalises over the hidden axis only: per token
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))  # (hd/2,)
    t = torch.arange(end).float()  # (end,)
    return torch.polar(torch.ones(end, head_dim // 2), torch.outer(t, freqs))  # (end, hd/2) complex


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, h, hd/2)
    freqs = freqs_cis.view(1, xc.size(1), 1, xc.size(-1))  # (1, T, 1, hd/2)
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)  # (B, T, h, hd)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.dim // cfg.n_head
        self.wq = nn.Linear(cfg.dim, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim)  # (B, T, nh, hd)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim)  # (B, T, nkv, hd)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim)  # (B, T, nkv, hd)
        q, k = apply_rotary(q, freqs_cis), apply_rotary(k, freqs_cis)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, h, T, hd)
        rep = self.n_head // self.n_kv_head
        k = k.repeat_interleave(rep, dim=1)  # (B, nh, T, hd)
        v = v.repeat_interleave(rep, dim=1)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, dim)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hidden = cfg.hidden_mult * cfg.dim
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, dim)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)  # (B, T, dim)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, T, dim)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        freqs = precompute_freqs_cis(cfg.dim // cfg.n_head, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("freqs_cis", freqs, persistent=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        freqs_cis = self.freqs_cis[:T]  # (T, hd/2) complex
        for layer in self.layers:
            h = layer(h, freqs_cis)  # (B, T, dim)
        return self.output(self.norm(h))  # (B, T, vocab)


def model(**overrides) -> Llama:
    """The default Llama; keyword arguments override LlamaConfig fields."""
    return Llama(replace(LlamaConfig(), **overrides))
