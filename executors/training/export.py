"""`tpc export`: from a sharded training checkpoint back to the plain model.

Export reads every parameter of a checkpoint (stored under the unsliced model's names, either
checkpoint format: `model_state.py`) and builds one state_dict of the *unsliced* model, which
loads with `model().load_state_dict(sd)` (strict):

- the model is rebuilt from the file and factory recorded in the checkpoint's tpc.json, so the
  state_dict has exactly the keys and order of `model().state_dict()`;
- a tied parameter (one tensor under several names, e.g. the embedding and the output head) is
  one tensor under every name the model's state_dict has for it;
- buffers (a causal mask, a RoPE table) are not trained and not checkpointed: they come from
  the model's own constructor.

It is written in one of three formats (`FORMATS`, chosen by `--format` or the output's suffix):

- `pt`: torch.save of the state_dict (model.pt; a tie stays one tensor under all its names);
- `safetensors`: the same tensors in a .safetensors file, a tie under its first name only (the
  format keeps no shared tensors; `safetensors.torch.load_model(model, path)` restores the tie,
  and `tpc run --init-from` accepts any of a tie's names);
- `hf`: for a Hugging Face model (one compiled from a config.json, or any model file returning a
  transformers `PreTrainedModel`), a model directory written by `save_pretrained`, which
  `AutoModelForCausalLM.from_pretrained(DIR)` loads back.

Beside model.pt (or .safetensors) goes model.pt.json (model file, factory, step), so `tpc
sample model.pt` can rebuild the model without the checkpoint; the weights file itself stays
plain.

`tpc sample` (training/generate.py) loads either for generation.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn

from tpc.executors.training.model_state import layout_of, listing, read_params
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.files import atomic_path, atomic_write_text, atomic_writer

FORMATS = ("pt", "safetensors", "hf")
_SUFFIXES = {".pt": "pt", ".pth": "pt", ".bin": "pt", ".safetensors": "safetensors"}


# ------------------------------------------------------------------------------ export


def export_format(output: str | os.PathLike, fmt: str | None) -> str:
    """The format to write: `fmt`, else by the output's suffix (.pt/.pth/.bin, .safetensors;
    none: a Hugging Face directory)."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise TpirError(Diagnostic(f"unknown export format {fmt!r}", where="--format",
                                       hint=f"use one of: {', '.join(FORMATS)}"))
        return fmt
    suffix = Path(output).suffix
    if suffix in _SUFFIXES:
        return _SUFFIXES[suffix]
    if suffix:
        raise TpirError(Diagnostic(f"-o {output}: cannot tell the format from the suffix {suffix!r}", where="-o",
                                   hint="name a .pt or .safetensors file, a directory (for a Hugging Face model), "
                                        f"or give --format {'|'.join(FORMATS)}"))
    return "hf"


def write_export(checkpoint: str | os.PathLike, output: str | os.PathLike,
                 fmt: str | None = None) -> tuple[dict, dict, str]:
    """Write the unsliced model's weights of `checkpoint` to `output` in format `fmt` (see
    `export_format`); beside a weights file, `output`.json (model file, factory, hash, step,
    shape). Returns the state_dict, the checkpoint's metadata and the format written."""
    fmt = export_format(output, fmt)
    sd, meta, model = _export(checkpoint)
    out = Path(output)
    if fmt == "hf":
        write_hf_directory(model, sd, out, meta)
        return sd, meta, fmt
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "pt":
        with atomic_writer(out, "wb") as f:
            torch.save(sd, f)
    else:
        write_safetensors(sd, out)
    sidecar = {k: meta[k] for k in ("model_path", "factory", "sha256", "step", "seq", "vocab") if k in meta}
    atomic_write_text(f"{out}.json", json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
    return sd, meta, fmt


def export_state_dict(checkpoint: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """The unsliced model's state_dict from a checkpoint (root or step directory), and its tpc.json."""
    sd, meta, _ = _export(checkpoint)
    return sd, meta


def _export(checkpoint) -> tuple[dict[str, torch.Tensor], dict, nn.Module]:
    step_dir, meta, layout = layout_of(checkpoint)
    model = build_model(meta)
    if not layout.names:
        raise TpirError(Diagnostic(f"{step_dir}: the checkpoint holds no parameters",
                                   hint="give a checkpoint written by `tpc run --checkpoint-dir`"))
    trained = read_params(step_dir, layout)
    return _assemble(model, trained, step_dir), meta, model


def write_safetensors(sd: dict[str, torch.Tensor], out: Path) -> None:
    """`sd` as a .safetensors file: each tensor once (a tie under its first name), contiguous."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for key, value in sd.items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        tensors[key] = value.detach().contiguous()
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})


def is_hf_model(model: nn.Module) -> bool:
    """A transformers `PreTrainedModel` (transformers is not imported for any other model)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def write_hf_directory(model: nn.Module, sd: dict[str, torch.Tensor], out: Path, meta: dict) -> None:
    """The model with the exported weights, saved by its own `save_pretrained` (config.json and
    safetensors): `AutoModelForCausalLM.from_pretrained(out)` loads it back."""
    if not is_hf_model(model):
        raise TpirError(Diagnostic(
            f"-o {out}: a Hugging Face model directory needs a Hugging Face model, and "
            f"{meta.get('model_path')} builds a {type(model).__name__}",
            where="--format", hint="export to a .pt or .safetensors file"))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TpirError(Diagnostic(f"-o {out}: exists and is not an empty directory", where="-o",
                                   hint="give a new directory for the Hugging Face model"))
    model.load_state_dict(sd, strict=True)
    # written into a folder beside `out` and renamed into place: a failure (a full disk, Ctrl-C)
    # leaves no half-written model directory where `from_pretrained` would read it
    import shutil
    import tempfile

    from tpc.ir.files import fsync_folder, write_error

    parent = out.resolve().parent
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as e:
        raise write_error(out, e) from e
    try:
        model.save_pretrained(str(tmp))
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
        fsync_folder(parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(out, e) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
    problems = ([f"not in the checkpoint: {listing(missing, ', ', 3)}"] if missing else []) + \
               ([f"shapes differ: {listing(wrong, '; ', 3)}"] if wrong else []) + \
               ([f"not in the model: {listing(extra, ', ', 3)}"] if extra else [])
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
