"""`tpc run --init-from PATH`: start a run from trained weights (step 0, a fresh optimizer).

The file's names are the model's own (`model.state_dict()` keys; files: `weight_files.py`).
Before anything is loaded, the file's names and shapes are checked against the whole unsliced
model (`ModelNames`), the same check on every rank:

- a tied weight may be stored under any of its names (Hugging Face stores it once, under its
  first name; torch.save under every name, as one tensor);
- buffers in the file (causal masks, position tables) are accepted and not loaded: they are not
  trained, and come from the model's constructor;
- names of parameters missing from the file, names the model does not have, and shapes that
  differ are refused, listing the first few of each.

Then each rank reads only the tensors of the parameters its own stages hold, cast to the
parameter's dtype (a bfloat16 file starts a float32 run). A parameter stored as integers or
booleans is refused: cast to float it would train from garbage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from tpc.executors.training.model_state import holders, listing
from tpc.executors.training.weight_files import WeightFile, open_weights
from tpc.ir.diagnostics import Diagnostic, TpirError


@dataclass(frozen=True)
class ModelNames:
    """The unsliced model's names: each parameter's canonical name (the first `named_parameters()`
    gives) with all its names and its shape, and the buffers."""

    aliases: dict[str, tuple[str, ...]]
    shapes: dict[str, tuple[int, ...]]
    buffers: frozenset[str]
    hf_config: dict | None = None  # a Hugging Face model's configuration

    @staticmethod
    def of(model: torch.nn.Module) -> "ModelNames":
        aliases: dict[str, list[str]] = {}
        first: dict[int, str] = {}
        shapes = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            canonical = first.setdefault(id(p), name)
            aliases.setdefault(canonical, []).append(name)
            shapes[canonical] = tuple(p.shape)
        buffers = frozenset(n for n, _ in model.named_buffers(remove_duplicate=False))
        config = getattr(model, "config", None)
        hf_config = config.to_dict() if hasattr(config, "to_dict") else None
        return ModelNames({k: tuple(v) for k, v in aliases.items()}, shapes, buffers, hf_config)


# configuration entries that say how a model was saved or run, not what it computes
_BOOKKEEPING = {"transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype", "use_cache",
                "attn_implementation", "_attn_implementation", "_attn_implementation_autoset", "output_attentions",
                "output_hidden_states", "return_dict", "id2label", "label2id"}


def config_differences(names: ModelNames, weights: WeightFile) -> list[str]:
    """Entries of a Hugging Face directory's config.json that differ from the model's own
    configuration ("rope_theta 10000.0 -> 500000.0"): the weights fit (names and shapes were
    checked) but may have been trained for another computation."""
    theirs = getattr(weights, "config", None)
    if not theirs or not names.hf_config:
        return []
    mine = names.hf_config
    return [f"{k} {theirs[k]!r} (model: {mine[k]!r})" for k in sorted(set(theirs) & set(mine))
            if k not in _BOOKKEEPING and theirs[k] != mine[k]]


def match(names: ModelNames, weights: WeightFile) -> dict[str, list[str]]:
    """canonical name -> the file's names for it (its aliases the file holds, the canonical one
    first when present); refused, naming them, when the file and the model disagree."""
    entries = weights.entries()
    chosen: dict[str, list[str]] = {}
    missing, wrong, kinds = [], [], []
    known: set[str] = set(names.buffers)
    for canonical, alias in names.aliases.items():
        known.update(alias)
        present = [a for a in alias if a in entries]
        if not present:
            missing.append(canonical if len(alias) == 1 else f"{canonical} (or {', '.join(alias[1:])})")
            continue
        chosen[canonical] = present
        shape = entries[present[0]][0]
        if shape != names.shapes[canonical]:
            wrong.append(f"{present[0]}: file {list(shape)}, model {list(names.shapes[canonical])}")
        dtype = entries[present[0]][1]
        if not dtype.is_floating_point:  # cast to float it would train from its integer values
            kinds.append(f"{present[0]}: {str(dtype).removeprefix('torch.')}")
    extra = sorted(n for n in entries if n not in known)
    if kinds and not (missing or extra or wrong):
        raise TpirError(Diagnostic(
            f"{weights.path}: the {weights.what} holds parameters that are not floating-point numbers "
            f"({len(kinds)}): {listing(kinds, '; ')}",
            where="--init-from",
            hint="a parameter's weights are floating-point (float32, bfloat16, float16): give the file "
                 "the model was trained into, not one of token ids, masks or quantised weights"))
    if missing or extra or wrong:
        parts = ([f"missing from the file ({len(missing)}): {listing(missing)}"] if missing else []) + \
                ([f"not in the model ({len(extra)}): {listing(extra)}"] if extra else []) + \
                ([f"shapes differ: {listing(wrong, '; ')}"] if wrong else [])
        raise TpirError(Diagnostic(
            f"{weights.path}: the {weights.what}'s names do not match the model: {' | '.join(parts)}",
            where="--init-from",
            hint="give weights of this model: names as its state_dict() has them (a prefix such as "
                 "'model.' or '_orig_mod.' added or missing is a different name)"))
    return chosen


def read_matched(weights: WeightFile, chosen: dict[str, list[str]], wanted) -> dict[str, torch.Tensor]:
    """The tensors of canonical names `wanted` (only those are read). A tie the file holds
    under several names must hold one value."""
    files = sorted({f for n in wanted for f in chosen[n]})
    tensors = weights.read(files)
    out = {}
    for n in wanted:
        first, *others = chosen[n]
        for other in others:
            if not torch.equal(tensors[first], tensors[other]):
                raise TpirError(Diagnostic(
                    f"{weights.path}: {first} and {other} are one tied parameter of the model, but the file "
                    f"holds different values for them", where="--init-from",
                    hint="these weights come from a model without this tie: start from weights of this model"))
        out[n] = tensors[first]
    return out


def init_engines(engines: Sequence, path: str | Path, names: ModelNames) -> WeightFile:
    """Copy the weights at `path` into the parameters of `engines`' stages; each tensor is read
    once, and only those of these engines' parameters."""
    weights = open_weights(path)
    chosen = match(names, weights)
    held = holders(engines)
    strange = sorted(n for n in held if n not in chosen)
    if strange:  # a stage's parameter the unsliced model does not name: the plan is not this model's
        raise TpirError(Diagnostic(f"the stages hold parameters the model does not have: {listing(strange)}",
                                   where="--init-from", hint="run a plan compiled from this model file"))
    tensors = read_matched(weights, chosen, list(held))
    with torch.no_grad():
        for name, copies in held.items():
            for h in copies:  # a part cut over the tensor axis: the rank's part of the weight
                h.param.copy_(tensors[name] if h.shard is None else h.shard.take(tensors[name], h.tensor_rank))
    return weights


def init_model(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the weights at `path` into the unsliced `model` (every parameter is read)."""
    names = ModelNames.of(model)
    weights = open_weights(path)
    chosen = match(names, weights)
    tensors = read_matched(weights, chosen, list(chosen))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
