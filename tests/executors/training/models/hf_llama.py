"""A Hugging Face Llama built from the config.json in hf_llama/ (2 layers, width 32, grouped-query
attention, tied embeddings), the way a model compiled from a config.json is built:
`AutoModelForCausalLM.from_config` with random weights from torch's generator, float32, SDPA
attention, and `forward(ids) -> logits` without the generation cache. The model keeps its class
(a subclass of the same name), its modules and Hugging Face's parameter names, so its weights
load from a directory `save_pretrained` wrote, and `tpc export` writes one back.

Nothing is downloaded: the configuration is read from the file beside this one. (A model file
standing in for `tpc compile path/to/config.json`, which builds the model the same way.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG = Path(__file__).resolve().parent / "hf_llama" / "config.json"


def config():
    from transformers import AutoConfig

    settings = json.loads(CONFIG.read_text(encoding="utf-8"))
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def returning_logits(model):
    """`model` with `forward(ids) -> logits`: the same object, its class replaced by a subclass of
    the same name whose forward returns the logits only."""
    base = type(model)

    def forward(self, input_ids):
        return base.forward(self, input_ids=input_ids, use_cache=False).logits  # (B, T, V)

    model.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                                    "__qualname__": base.__qualname__})
    return model


def model():
    from transformers import AutoModelForCausalLM

    return returning_logits(AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa",
                                                             dtype=torch.float32))
