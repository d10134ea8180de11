"""A user's wrapper around a Hugging Face decoder built from a config object."""

import torch.nn as nn


class LM(nn.Module):
    def __init__(self, model_type, impl="sdpa", **settings):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model(model_type, **settings)
        self.m = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)

    def forward(self, ids):
        return self.m(input_ids=ids).logits  # use_cache left on
