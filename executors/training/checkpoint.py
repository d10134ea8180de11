"""Sharded training checkpoints with torch.distributed.checkpoint (DCP): the files.

Layout of a checkpoint directory DIR:

    DIR/step_000020/            one complete checkpoint: DCP files (.metadata, *.distcp) ...
    DIR/step_000020/tpc.json    ... and what it belongs to: format, step, model, plan, mesh
    DIR/latest                  text file naming the newest complete step directory
    DIR/best/                   with --save-best: the checkpoint of the lowest validation loss
                                (its tpc.json has "val_loss"), replaced as a better one comes

This module writes and reads a checkpoint whatever its keys: a dict of tensors and plain values
(nested dicts are stored under their dotted paths). Which keys a run writes, and how a run of
another plan finds its parameters in them, is `model_state.py` (format 2: keyed by the unsliced
model's parameter names; format 1, written by earlier versions: one shard per rank). Under
torchrun every process passes its own part and DCP writes them in parallel into one directory,
an entry several processes hold (a replicated parameter, the step) written once; the
interpreter passes everything from one process (`no_dist`). Both write the same files.

Saving is atomic: the shards go to DIR/.tmp_step_000020, tpc.json is written last, then the
directory is renamed to step_000020 and `latest` is replaced via a temporary file and
os.replace. A crash at any point before the rename leaves `latest` naming the previous complete
checkpoint, which still loads; a stale .tmp_ directory is removed by the next save.

Loading is in place: the caller passes a template holding the live tensors (parameters,
optimizer state) under the stored keys and DCP copies the stored values into them; each process
reads only the entries of its template. Plain values (step, data position) are replaced in the
template.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.files import atomic_write_text, fsync_folder

FORMAT = 2  # the layout `tpc run` writes (model_state.py)
READABLE = (1, 2)  # the layouts this version reads
META_FILE = "tpc.json"
LATEST = "latest"
BEST = "best"  # the checkpoint of the lowest validation loss (--save-best), beside `latest`
_PREFIX = "step_"
_TMP = ".tmp_"
# a template section whose entries may be absent from a checkpoint (see _without_missing_optional)
_OPTIONAL = "rng"


# ------------------------------------------------------------------------------ layout


def step_dir_name(step: int) -> str:
    """`step_000020`: zero-padded so directory listings sort by step."""
    return f"{_PREFIX}{step:06d}"


def run_meta(header, plan_sha256: str, optimizer: str) -> dict:
    """What tpc.json records about the run, from the plan's header (`tpc.ir.nodes.Header`): the
    model (file, factory and file hash: a resume needs the same model; `tpc export` and `tpc
    sample` rebuild it), the optimizer kind (its state must fit), and the plan that wrote it
    (hash, mesh and a summary, for the line a resume under another plan prints). The model
    path is made absolute: export may run from another directory."""
    return {
        "plan_sha256": plan_sha256,
        "mesh": {"pipe": header.mesh.pipe, "data": header.mesh.data},
        "plan": plan_summary(header),
        "optimizer": optimizer,
        "model_path": os.path.abspath(header.model.path),
        "factory": header.model.factory,
        "sha256": header.model.sha256,
        "seq": header.shape.seq,
        "vocab": header.shape.vocab,
    }


def plan_summary(header) -> dict[str, str]:
    """The plan in a few words, each entry comparable on its own: mesh (pipe x data), stages (unit
    ranges, with their ranks when a rank holds several), schedule, micro-batches (a replica's
    rows), token slices (lengths; per micro-batch when they differ) and the sequence length."""
    stages = " ".join(f"{st.units[0]}:{st.units[1]}" for st in header.stages)
    if any(st.rank != st.index for st in header.stages):
        stages += " on ranks " + ",".join(str(st.rank) for st in header.stages)
    slices = [",".join(str(hi - lo) for lo, hi in mb.slices) for mb in header.microbatches]
    sizes = [mb.size for mb in header.microbatches]
    return {
        "mesh": f"{header.mesh.pipe}x{header.mesh.data}",
        "stages": stages,
        "schedule": header.schedule.name,
        "micro-batches": (f"{len(sizes)} of {sizes[0]} rows" if len(set(sizes)) == 1
                          else "of " + ",".join(map(str, sizes)) + " rows"),
        "slices": slices[0] if len(set(slices)) == 1 else " | ".join(slices),
        "seq": str(header.shape.seq),
    }


# ------------------------------------------------------------------------------ saving


def save_checkpoint(dir: str | os.PathLike, step: int, shards: dict[str, Any], meta: dict, *,
                    process_group=None, name: str | None = None) -> Path:
    """Write `shards` as checkpoint `step` under `dir` and make it the latest; returns its path.
    `meta` goes into tpc.json with the step (and "format": FORMAT unless it names its own).
    With `name` (BEST: `--save-best`) it is written as DIR/NAME instead, replacing the one there
    as atomically, and `latest` is left alone.

    Without an initialised process group (the interpreter, tests) one process writes all
    shards. Under torchrun every rank of `process_group` (default: the world) must call this
    with its own shards (unique keys) and the same step and meta; group rank 0 publishes.
    """
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    _check_structure(shards, "")
    root = Path(dir)
    final = root / (name or step_dir_name(step))
    tmp = root / (_TMP + final.name)
    distributed = _distributed(process_group)
    leader = not distributed or dist.get_rank(process_group) == 0

    if leader:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a save that crashed
            shutil.rmtree(tmp)
        tmp.mkdir()
    if distributed:
        dist.barrier(group=process_group)
    _write_shards(tmp, shards, process_group, distributed)
    if leader:
        _write_meta(tmp, {"format": FORMAT, **meta, "step": step})
        if name is None:
            _publish(root, tmp, final)
        else:
            _replace_dir(root, tmp, final)
    if distributed:
        # no rank goes on (and possibly exits) before the checkpoint is complete
        dist.barrier(group=process_group)
    return final


def _write_shards(tmp: Path, shards: dict, process_group, distributed: bool) -> None:
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process when none is initialised: that is intended
        warnings.simplefilter("ignore")
        dcp.save(shards, checkpoint_id=str(tmp), process_group=process_group, no_dist=not distributed)


def _write_meta(tmp: Path, meta: dict) -> None:
    """tpc.json goes in last: a step directory with it is complete."""
    atomic_write_text(tmp / META_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished directory into place, then point `latest` at it."""
    _replace_dir(root, tmp, final)
    atomic_write_text(root / LATEST, final.name + "\n")


def _replace_dir(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished directory `tmp` to `final`, replacing one already there."""
    old = None
    if final.exists():  # the same step saved again (a resumed run): keep it until replaced
        old = root / (_TMP + "old_" + final.name)
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_folder(root)
    if old is not None:
        shutil.rmtree(old)


# ------------------------------------------------------------------------------ finding


def is_complete(step_dir: Path) -> bool:
    return (step_dir / META_FILE).is_file() and (step_dir / ".metadata").is_file()


def latest_checkpoint(dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `dir`, or None when there is none.

    `latest` is trusted when it names a complete directory; otherwise (a crash between the two
    renames of a re-save, a hand-deleted directory) the newest complete step_* directory is."""
    root = Path(dir)
    if not root.is_dir():
        return None
    pointer = root / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            name = ""  # unreadable: the newest complete step_* directory decides, as below
        if name.startswith(_PREFIX) and "/" not in name and is_complete(root / name):
            return root / name
    steps = sorted(p for p in root.glob(_PREFIX + "*") if p.is_dir() and is_complete(p))
    return steps[-1] if steps else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory, given either it or the checkpoint root (then its latest)."""
    p = Path(path)
    if not p.exists():
        raise TpirError(Diagnostic(f"no such checkpoint: {p}",
                                   hint="give a directory written by `tpc run --checkpoint-dir DIR` "
                                        "(DIR itself or DIR/step_NNNNNN)"))
    if p.is_dir() and is_complete(p):
        return p
    if p.is_dir() and p.name.startswith(_PREFIX):
        raise _corrupt(p, f"{META_FILE} or .metadata is missing (the save did not finish)")
    found = latest_checkpoint(p) if p.is_dir() else None
    if found is None:
        raise TpirError(Diagnostic(f"{p}: no complete checkpoint in this directory",
                                   hint="train with `tpc run --checkpoint-dir DIR --save-every N` first"))
    return found


def read_meta(path: str | os.PathLike) -> dict:
    """tpc.json of a checkpoint (root or step directory)."""
    step_dir = resolve_checkpoint(path)
    try:
        meta = json.loads((step_dir / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _corrupt(step_dir, f"{META_FILE} is unreadable ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or "format" not in meta:
        raise _corrupt(step_dir, f"{META_FILE} is not a tpc checkpoint description")
    if meta["format"] not in READABLE:
        raise TpirError(Diagnostic(
            f"{step_dir}: the checkpoint is of format {meta['format']!r}; this version of tpc reads "
            f"formats {', '.join(map(str, READABLE))}",
            hint="read it with the tpc that wrote it (`tpc export` gives a plain state_dict any version "
                 "can start from with --init-from)"))
    return meta


def stored_entries(path: str | os.PathLike) -> dict[str, Any]:
    """Flat key -> DCP storage metadata (TensorStorageMetadata has .size and .properties.dtype)."""
    step_dir = resolve_checkpoint(path)
    return dict(_read_metadata(step_dir).state_dict_metadata)


def _read_metadata(step_dir: Path):
    try:
        return dcp.FileSystemReader(str(step_dir)).read_metadata()
    except Exception as e:  # DCP raises assorted errors for a damaged .metadata
        raise _corrupt(step_dir, f"the DCP metadata is unreadable ({type(e).__name__}: {e})") from None


def _check_data_files(step_dir: Path, keys) -> None:
    """The data files holding `keys` exist and are as long as the metadata says (a shard cut short
    by a full disk or an interrupted copy is named before anything is read)."""
    storage = getattr(_read_metadata(step_dir), "storage_data", None)
    if not isinstance(storage, Mapping):
        return
    keys = set(keys)
    need: dict[str, int] = {}
    for index, info in storage.items():
        if getattr(index, "fqn", None) in keys and hasattr(info, "relative_path"):
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = step_dir / name
        if not f.is_file():
            raise _corrupt(step_dir, f"the data file {name} is missing")
        have = f.stat().st_size
        if have < size:
            raise _corrupt(step_dir, f"the data file {name} is {have} bytes, its entries need {size} (truncated)")


# ------------------------------------------------------------------------------ loading


def load_checkpoint(path: str | os.PathLike, shards_template: dict[str, Any], *, process_group=None,
                    no_dist: bool | None = None) -> dict[str, Any]:
    """Load into `shards_template` in place and return it.

    Tensors in the template receive the stored values (shapes and dtypes must match); plain
    values are replaced. Keys stored but not in the template are ignored, so each process reads
    only what its template names; RNG states the checkpoint lacks (another device kind, another
    rank) are left as they are. A template entry that is not stored, or stored with another
    shape or dtype, is refused before anything is read. `no_dist=True` reads in this process
    alone even under torchrun (every rank reading weights for itself, no collective).
    """
    step_dir = resolve_checkpoint(path)
    read_meta(step_dir)
    _check_structure(shards_template, "")
    stored = stored_entries(step_dir)
    to_load = _without_missing_optional(shards_template, stored)
    flat = _flatten(to_load)
    _check_against_stored(step_dir, flat, stored)
    _check_data_files(step_dir, flat)
    distributed = _distributed(process_group) if no_dist is None else not no_dist
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(to_load, checkpoint_id=str(step_dir), process_group=process_group,
                     no_dist=not distributed)
    except (Exception, CheckpointException) as e:  # data damaged although its length is right
        raise _corrupt(step_dir, f"reading the shards failed ({_cause(e)})") from None
    _copy_back(to_load, shards_template)
    return shards_template


def _without_missing_optional(tree: Mapping, stored: Mapping, prefix: str = "") -> dict:
    """A view of the template (the same leaf objects, new dicts) without entries under an
    optional section ("rng") that the checkpoint lacks: RNG states depend on the device kind, and
    a CPU run resumed on CUDA has a CUDA generator state to keep, not to load. Loading into the
    view fills the template's own tensors; plain values are copied back by the caller."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping):
            out[k] = _without_missing_optional(v, stored, key)
        elif key in stored or _OPTIONAL not in key.split(".")[:-1]:
            out[k] = v
    return out


def _copy_back(view: Mapping, tree: dict) -> None:
    """Plain values loaded into the view go back into the template (tensors were filled in place)."""
    for k, v in view.items():
        if isinstance(v, Mapping):
            _copy_back(v, tree[k])
        else:
            tree[k] = v


def _check_against_stored(step_dir: Path, flat: dict[str, Any], stored: dict[str, Any]) -> None:
    problems = []
    for key, value in flat.items():
        entry = stored.get(key)
        if entry is None:
            problems.append(f"{key} is not in the checkpoint")
        elif isinstance(value, torch.Tensor):
            if not isinstance(entry, TensorStorageMetadata):
                problems.append(f"{key} is stored as a plain value, expected a tensor")
            elif tuple(entry.size) != tuple(value.shape) or entry.properties.dtype != value.dtype:
                problems.append(f"{key} is stored as {entry.properties.dtype} {list(entry.size)}, "
                                f"expected {value.dtype} {list(value.shape)}")
        elif not isinstance(entry, BytesStorageMetadata):
            problems.append(f"{key} is stored as a tensor, expected a plain value")
    if problems:
        shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
        raise TpirError(Diagnostic(f"{step_dir}: the checkpoint does not match this run: " + "; ".join(shown),
                                   hint="it was written for another model (names or shapes differ): resume "
                                        "with a plan of the model that wrote it, or use another --checkpoint-dir"))


# ------------------------------------------------------------------------------ pieces of a state


def restore_rng(rng: Mapping) -> None:
    """Set this process's RNG states from loaded `rng_state()` entries."""
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["torch_cuda"])
    random.setstate(rng["python"])


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def optimizer_state(optimizer: torch.optim.Optimizer, named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> dict:
    """The optimizer's per-parameter state keyed by parameter name (torch's own state_dict keys
    it by position, which differs between a split and a whole model). Hyperparameters are not
    saved: they come from the command line, and the rate from `lr_at(step)`."""
    names = {id(p): n for n, p in named_params}
    out: dict[str, dict] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in optimizer.state:
                if id(p) not in names:
                    raise ValueError("optimizer holds a parameter missing from named_params")
                out[names[id(p)]] = dict(optimizer.state[p])  # same tensors: loads go into them
    return out


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (AdamW: step, exp_avg, exp_avg_sq) so a fresh
    optimizer can be the template of a load: one step with zero gradients and rate 0, which
    changes no weight. No-op when the state exists or the optimizer keeps none (plain SGD)."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise ValueError("init_optimizer_state needs parameters without gradients")
    saved = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------ helpers


def _distributed(process_group) -> bool:
    return process_group is not None or (dist.is_available() and dist.is_initialized())


def _check_structure(tree: Any, prefix: str) -> None:
    """Shards are nested dicts with str keys; DCP stores a list holding tensors differently from
    a dict, so lists and tuples may hold plain values only. A programming error, not user input."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            if not isinstance(k, str):
                raise TypeError(f"checkpoint keys must be str, got {k!r} under {prefix or 'the root'}")
            _check_structure(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(tree, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping)) for v in tree):
        raise TypeError(f"{prefix}: tensors and dicts inside lists are not supported; use a dict")


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """Flat keys the way DCP names them: nested dict keys joined with '.'."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _corrupt(step_dir: Path, what: str) -> TpirError:
    return TpirError(Diagnostic(f"{step_dir}: corrupt checkpoint: {what}",
                                hint="resume from an earlier step directory, or delete this one "
                                     "(`latest` falls back to the newest complete checkpoint)"))


def _cause(e: BaseException) -> str:
    """The first failure a DCP CheckpointException carries (one per rank), else `e` itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, Mapping) and failures:
        first = next(iter(failures.values()))
        if isinstance(first, (list, tuple)) and first:
            first = first[0]
        if isinstance(first, BaseException):
            e = first
        elif isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            e = first[0]
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""
