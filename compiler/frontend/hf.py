"""A Hugging Face `config.json` as a model file: `tpc compile path/to/config.json`.

The configuration is read from the file alone (nothing is downloaded) and the model is built
with `AutoModelForCausalLM.from_config`, with random weights drawn from torch's generator as any
model file's factory would, in float32 (a `torch_dtype` in the file is not applied: the plan
trains float32 weights; `tpc run --precision` chooses the compute precision). The attention
implementation is the file's (`attn_implementation` or `_attn_implementation`), else
transformers' default for the model: `sdpa` where the model offers it, `eager` where it does not
(BLOOM, MPT, GPT-Neo).

The model keeps its own class, parameter names (`model.layers.0.self_attn.q_proj.weight`) and
modules; only its `forward` changes, to take the token ids and return the logits (no cache),
which is what a tpc model returns. So the plan, the stage parameters and checkpoints use the
names Hugging Face uses, and no wrapper is needed.
"""

from __future__ import annotations

import json
import re

import torch
import torch.nn as nn

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Loc


def is_config_file(path: str) -> bool:
    return str(path).lower().endswith(".json")


def causal_lm_from_config(path: str) -> nn.Module:
    """The causal LM a Hugging Face `config.json` describes, returning logits from ids."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise TpirError(Diagnostic(f"the model configuration is not valid JSON: {e.msg}",
                                   loc=Loc(path, e.lineno, e.colno),
                                   hint="give a Hugging Face config.json (the file saved beside a model's weights)")) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise TpirError(Diagnostic("the JSON file has no \"model_type\": it is not a Hugging Face model configuration",
                                   loc=Loc(path, 1, 1),
                                   hint="give a config.json with \"model_type\" (e.g. \"llama\"), or a Python model file"))
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise TpirError(Diagnostic("a Hugging Face config.json needs the `transformers` package, which is not installed",
                                   loc=Loc(path, 1, 1),
                                   hint="pip install transformers (it does not change the installed torch)")) from None
    if raw.get("output_router_logits") is True:
        raise TpirError(Diagnostic(
            "the configuration asks for the mixture-of-experts auxiliary load-balancing loss "
            "(\"output_router_logits\": true), which a plan does not train: the plan's loss is the "
            "next-token cross-entropy of the logits, and the auxiliary loss is a statistic over all the "
            "batch's tokens that token slices do not see together",
            loc=_key_loc(path, "output_router_logits"),
            hint="set \"output_router_logits\": false to train the language-model loss alone"))
    settings = dict(raw)
    model_type = settings.pop("model_type")
    attn = settings.pop("attn_implementation", None) or settings.pop("_attn_implementation", None)
    for key in ("torch_dtype", "dtype", "transformers_version", "architectures"):
        settings.pop(key, None)
    try:
        config = AutoConfig.for_model(model_type, **settings)
    except Exception as e:
        raise TpirError(Diagnostic(f"transformers cannot read this configuration: {type(e).__name__}: {e}",
                                   loc=Loc(path, 1, 1),
                                   hint="check \"model_type\" and the keys against the transformers version installed")) from None
    try:
        chosen = {"attn_implementation": attn} if attn else {}  # else sdpa where the model offers it
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **chosen)
    except Exception as e:
        if out_of_memory(e):  # not a configuration transformers cannot read: the memory ran out
            raise model_out_of_memory(e, Loc(path, 1, 1)) from None
        raise TpirError(Diagnostic(f"transformers cannot build a causal LM from this configuration: "
                                   f"{type(e).__name__}: {e}",
                                   loc=Loc(path, 1, 1),
                                   hint="tpc trains causal language models (AutoModelForCausalLM); check "
                                        "\"model_type\" and \"attn_implementation\" (sdpa or eager)")) from None
    return returning_logits(model)


def _key_loc(path: str, key: str) -> Loc:
    """Where `"key"` first appears in the JSON file (its first line when not found)."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            col = line.find(f'"{key}"')
            if col >= 0:
                return Loc(path, i, col + 1)
    return Loc(path, 1, 1)


_NO_MEMORY = ("out of memory", "can't allocate memory", "cannot allocate memory")


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is memory running out: Python's MemoryError, or torch's allocator failing
    ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory")."""
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError)
                                          and any(w in str(e).lower() for w in _NO_MEMORY))


def model_out_of_memory(e: BaseException, loc: Loc) -> TpirError:
    """The error of a model whose build ran out of memory, at `loc` (its file), in words."""
    asked = re.search(r"allocate (\d+) bytes", str(e))
    first = (str(e).strip().splitlines() or [""])[0][:200]
    what = (f"a tensor of {int(asked.group(1)) / 2**30:.1f} GiB could not be allocated" if asked
            else f"{type(e).__name__}" + (f": {first}" if first else ""))
    return TpirError(Diagnostic(
        f"building the model ran out of memory ({what})",
        loc=loc, hint="the whole model is built in float32 in this process before it is cut into stages, so it "
                      "needs its parameters' size in free memory here: try a smaller configuration (fewer "
                      "layers, a narrower hidden size, a smaller vocabulary), or a machine with more free memory"))


def returning_logits(model: nn.Module) -> nn.Module:
    """`model` (a transformers causal LM) with `forward(ids) -> logits`; same object, same
    class name, module and parameter names."""
    base = type(model)
    if base not in _LOGITS_CLASSES:

        def forward(self, input_ids):
            """ids (B, T) int64 -> logits (B, T, V), without the generation cache."""
            return base.forward(self, input_ids=input_ids, use_cache=False).logits

        _LOGITS_CLASSES[base] = type(base.__name__, (base,), {
            "forward": forward, "__module__": base.__module__, "__qualname__": base.__qualname__})
    model.__class__ = _LOGITS_CLASSES[base]
    return model


_LOGITS_CLASSES: dict[type, type] = {}
