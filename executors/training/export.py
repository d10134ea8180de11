"""`tpc export`: from a sharded training checkpoint back to the plain model.

Export gathers every stage's parameters from the rank shards of a checkpoint (they are stored
under the original model's parameter names) and writes one state_dict of the *unsliced* model,
which loads with `model().load_state_dict(sd)` (strict):

- the model is rebuilt from the file and factory recorded in the checkpoint's tpc.json, so the
  state_dict has exactly the keys and order of `model().state_dict()`;
- a tied parameter (one tensor under several names, e.g. the embedding and the output head) is
  held by several ranks; the copy of the lowest rank is written once, under every name the
  model's state_dict has for it (torch.save keeps them one tensor);
- buffers (a causal mask, a RoPE table) are not trained and not checkpointed: they come from
  the model's own constructor.

Beside model.pt goes model.pt.json (model file, factory, step), so `tpc sample model.pt` can
rebuild the model without the checkpoint; model.pt itself stays a plain state_dict.

`tpc sample` (training/generate.py) loads either for generation.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn as nn

from tpc.executors.training.checkpoint import load_checkpoint, read_meta, resolve_checkpoint, stored_entries
from tpc.ir.diagnostics import Diagnostic, TpirError

_PARAM_KEY = re.compile(r"^rank(\d+)\.params\.(.+)$")


# ------------------------------------------------------------------------------ export


def write_export(checkpoint: str | os.PathLike, output: str | os.PathLike) -> tuple[dict, dict]:
    """Write the unsliced model's state_dict of `checkpoint` to `output` (a .pt) and, beside it,
    `output`.json (model file, factory, hash, step, shape). Returns the state_dict and the
    checkpoint's metadata."""
    sd, meta = export_state_dict(checkpoint)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sd, out)
    sidecar = {k: meta[k] for k in ("model_path", "factory", "sha256", "step", "seq", "vocab") if k in meta}
    Path(f"{out}.json").write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return sd, meta


def export_state_dict(checkpoint: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """The unsliced model's state_dict from a checkpoint (root or step directory), and its tpc.json."""
    step_dir = resolve_checkpoint(checkpoint)
    meta = read_meta(step_dir)
    model = build_model(meta)
    trained = _gather_params(step_dir)
    return _assemble(model, trained, step_dir), meta


def build_model(meta: dict) -> nn.Module:
    """`factory()` of the model file recorded in a checkpoint's (or export's) metadata."""
    from tpc.compiler.frontend.model_file import file_sha256, load_model

    path = meta.get("model_path")
    if not path:
        raise TpirError(Diagnostic("the checkpoint does not record its model file",
                                   hint="it was written by an older tpc; export needs tpc.json's model_path"))
    if not os.path.isfile(path):
        raise TpirError(Diagnostic(f"the model file the checkpoint was trained from is gone: {path}",
                                   hint="restore the file at that path (tpc.json in the checkpoint records it)"))
    if meta.get("sha256") and file_sha256(path) != meta["sha256"]:
        print(f"warning: {path} has changed since the checkpoint was written; "
              "the weights load only if the parameter names and shapes are the same", file=sys.stderr)
    return load_model(path, meta.get("factory", "model"))


def _gather_params(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every parameter stored by any rank, each from the lowest rank holding it (data replica 0,
    and for a tie the first stage's copy). All copies of a parameter are equal after a step, so
    which one is read does not matter; the lowest is a deterministic choice."""
    owner: dict[str, int] = {}
    shapes: dict[str, tuple] = {}
    for key, entry in stored_entries(step_dir).items():
        m = _PARAM_KEY.match(key)
        if m is None:
            continue
        rank, name = int(m.group(1)), m.group(2)
        if name not in owner or rank < owner[name]:
            owner[name] = rank
            shapes[name] = (tuple(entry.size), entry.properties.dtype)
    if not owner:
        raise TpirError(Diagnostic(f"{step_dir}: the checkpoint holds no parameters",
                                   hint="give a checkpoint written by `tpc run --checkpoint-dir`"))
    template: dict[str, dict] = {}
    for name, rank in owner.items():
        size, dtype = shapes[name]
        template.setdefault(f"rank{rank}", {}).setdefault("params", {})[name] = torch.empty(size, dtype=dtype)
    load_checkpoint(step_dir, template)
    return {name: template[f"rank{rank}"]["params"][name] for name, rank in owner.items()}


def _assemble(model: nn.Module, trained: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """Fill `model.state_dict()`'s keys: parameters from `trained` (through any alias of a tied
    tensor), buffers from the model itself. Every stored parameter must find a place."""
    aliases = _alias_groups(model)
    base = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing, wrong = [], []
    for key, value in base.items():
        if key not in aliases:  # a buffer: from the model's constructor
            out[key] = value
            continue
        found = [n for n in aliases[key] if n in trained]
        if not found:
            missing.append(key)
            continue
        tensor = trained[found[0]]
        used.update(found)
        if tuple(tensor.shape) != tuple(value.shape):
            wrong.append(f"{key}: checkpoint {list(tensor.shape)}, model {list(value.shape)}")
            continue
        out[key] = tensor.to(value.dtype)
    extra = sorted(set(trained) - used)
    problems = ([f"not in the checkpoint: {_listing(missing, ', ')}"] if missing else []) + \
               ([f"shapes differ: {_listing(wrong, '; ')}"] if wrong else []) + \
               ([f"not in the model: {_listing(extra, ', ')}"] if extra else [])
    if problems:
        raise TpirError(Diagnostic(f"{where}: the checkpoint does not fit the model file ({' | '.join(problems)})",
                                   hint="export with the model file (and factory) the run was trained with"))
    # one tensor per tie, shared by all its names
    shared: dict[int, torch.Tensor] = {}
    for key in out:
        if key in aliases:
            group = id(aliases[key])
            out[key] = shared.setdefault(group, out[key])
    return out


def _listing(items: list[str], sep: str, show: int = 3) -> str:
    more = f"{sep}... ({len(items) - show} more)" if len(items) > show else ""
    return sep.join(items[:show]) + more


def _alias_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Parameter name -> every name of the same tensor (one entry per name; the same tuple
    object for all names of a tie)."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    out = {}
    for names in by_tensor.values():
        group = tuple(names)
        for n in names:
            out[n] = group
    return out
