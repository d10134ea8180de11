"""A user's wrapper around a Hugging Face BERT (a bidirectional encoder) with an LM head."""

import torch.nn as nn


class Encoder(nn.Module):
    def __init__(self, impl):
        super().__init__()
        from transformers import BertConfig, BertLMHeadModel

        cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        self.hf = BertLMHeadModel._from_config(cfg, attn_implementation=impl)

    def forward(self, ids):
        return self.hf(input_ids=ids).logits  # the user's own line


def sdpa() -> nn.Module:
    return Encoder("sdpa")


def eager() -> nn.Module:
    return Encoder("eager")
