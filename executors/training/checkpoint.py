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
checkpoint, which still loads; a stale .tmp_ directory is removed by the next save. A save that
fails (a full disk, a read-only folder: an OSError) or is interrupted (Ctrl-C) removes its
temporary directory and says so, naming the checkpoint that is still the latest; Ctrl-C during
the final renames waits for them.

Checksums: tpc.json records the sha256 and size of every other file of the checkpoint ("files");
a load verifies the files it reads (the DCP .metadata and the data files of its entries) and
refuses one that changed since it was saved (a flipped byte, a truncated copy), naming it.
Checkpoints written before checksums were recorded load unverified (`is_verified`).

Loading is in place: the caller passes a template holding the live tensors (parameters,
optimizer state) under the stored keys and DCP copies the stored values into them; each process
reads only the entries of its template. Plain values (step, data position) are replaced in the
template.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from tpc.executors.training.shard_pieces import Chunks, load_planner, save_planner
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.files import atomic_write_text, describe_os_error, fsync_folder

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
        "mesh": {"pipe": header.mesh.pipe, "data": header.mesh.data,
                 **({"tensor": header.mesh.tensor} if header.mesh.tensor != 1 else {})},
        "plan": plan_summary(header),
        "optimizer": optimizer,
        "model_path": os.path.abspath(header.model.path),
        "factory": header.model.factory,
        "sha256": header.model.sha256,
        "seq": header.shape.seq,
        "vocab": header.shape.vocab,
    }


def plan_summary(header) -> dict[str, str]:
    """The plan in a few words, each entry comparable on its own: mesh (pipe x data, and
    x tensor with a tensor axis), stages (unit
    ranges, with their ranks when a rank holds several), schedule, micro-batches (a replica's
    rows), token slices (lengths; per micro-batch when they differ) and the sequence length."""
    stages = " ".join(f"{st.units[0]}:{st.units[1]}" for st in header.stages)
    if any(st.rank != st.index for st in header.stages):
        stages += " on ranks " + ",".join(str(st.rank) for st in header.stages)
    slices = [",".join(str(hi - lo) for lo, hi in mb.slices) for mb in header.microbatches]
    sizes = [mb.size for mb in header.microbatches]
    return {
        "mesh": f"{header.mesh.pipe}x{header.mesh.data}" + (f"x{header.mesh.tensor}" if header.mesh.tensor != 1 else ""),
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
    distributed = is_distributed(process_group)
    leader = not distributed or dist.get_rank(process_group) == 0
    failed = _SaveFailure(root, final, step, tmp, leader)

    # 1. a fresh temporary directory (rank 0), which every rank then writes into
    problem = failed.run(lambda: _fresh_dir(root, tmp)) if leader else None
    failed.agree(problem, process_group, distributed)
    # 2. the shards, every rank its own (DCP tells every rank of any rank's failure)
    try:
        _write_shards(tmp, shards, process_group, distributed)
    except BaseException as e:  # noqa: BLE001 - a full disk, Ctrl-C: said in words, below
        raise failed.translate(e) from None
    # 3. their checksums, each rank a share of the files, gathered by rank 0 into tpc.json
    files = _gather_checksums(tmp, process_group, distributed, failed)
    # 4. tpc.json and the rename into place (rank 0), not to be cut by Ctrl-C half-way
    problem = None
    if leader:
        def publish():
            with _interrupt_deferred():
                _write_meta(tmp, {"format": FORMAT, **meta, "step": step, "files": files})
                if name is None:
                    _publish(root, tmp, final)
                else:
                    _replace_dir(root, tmp, final)
        problem = failed.run(publish)
    # no rank goes on (and possibly exits) before the checkpoint is complete
    failed.agree(problem, process_group, distributed)
    return final


def _fresh_dir(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():  # left by a save that crashed
        shutil.rmtree(tmp)
    tmp.mkdir()


def _write_shards(tmp: Path, shards: dict, process_group, distributed: bool) -> None:
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process when none is initialised: that is intended
        warnings.simplefilter("ignore")
        dcp.save(shards, checkpoint_id=str(tmp), process_group=process_group, no_dist=not distributed,
                 planner=save_planner())


class _SaveFailure:
    """What a save that failed says, and the cleaning up after it: the half-written temporary
    directory goes (a full disk gets its space back); `latest` and the checkpoints before it were
    never touched. A full disk or a read-only folder (an OSError) and Ctrl-C are said in words;
    anything else is a bug and propagates as it is."""

    def __init__(self, root: Path, final: Path, step: int, tmp: Path, leader: bool):
        self.root, self.final, self.step, self.tmp, self.leader = root, final, step, tmp, leader

    def run(self, fn) -> "list[Diagnostic] | None":
        """Run rank 0's part; the diagnostics of its failure (raised here too unless an OSError,
        which every rank raises alike in `agree`)."""
        try:
            fn()
            return None
        except BaseException as e:  # noqa: BLE001 - translated, or re-raised as it is
            error = self.translate(e)
            if isinstance(error, TpirError):
                return error.diagnostics
            raise error from None

    def agree(self, problem, process_group, distributed: bool) -> None:
        """Every rank learns rank 0's outcome (a sync point) and fails alike."""
        if distributed:
            box = [problem]
            dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0)
                                       if process_group is not None else 0, group=process_group)
            problem = box[0]
        if problem:
            raise TpirError(problem)

    def translate(self, e: BaseException) -> BaseException:
        """The error to raise for `e`: a TpirError for an OSError, a KeyboardInterrupt that says
        what was kept for Ctrl-C, `e` itself otherwise. Cleans up first (rank 0)."""
        cause = _root_cause(e)
        if isinstance(cause, KeyboardInterrupt):
            self.clean()
            return KeyboardInterrupt(f"while saving checkpoint {self.final.name} (step {self.step}): "
                                     f"nothing of it was kept; {self.kept()}")
        if isinstance(cause, TpirError):  # a write of ir/files.py, already in words
            self.clean()
            return TpirError([Diagnostic(f"{self.what()}: {d.message}", hint=self.hint(d.hint))
                              for d in cause.diagnostics])
        if isinstance(cause, OSError):
            self.clean()
            reason, hint = describe_os_error(cause)
            where = f" ({cause.filename})" if getattr(cause, "filename", None) else ""
            return TpirError(Diagnostic(f"{self.what()}: {reason}{where}", hint=self.hint(hint)))
        return e

    def what(self) -> str:
        return f"cannot save checkpoint {self.final.name} (step {self.step}) in {self.root}"

    def kept(self) -> str:
        before = latest_checkpoint(self.root) if self.root.is_dir() else None
        if before is None:
            return "no earlier checkpoint of this run was saved"
        return f"the checkpoint before it, {before}, is as it was (--resume continues from it)"

    def hint(self, hint: str | None) -> str:
        return f"{hint + '; ' if hint else ''}nothing of this checkpoint was kept, and {self.kept()}"

    def clean(self) -> None:
        if self.leader:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _root_cause(e: BaseException) -> BaseException:
    """The OSError, KeyboardInterrupt or TpirError behind `e` (DCP wraps each rank's failure in a
    CheckpointException), else `e`."""
    seen = set()
    todo = [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (OSError, KeyboardInterrupt, TpirError)):
            return x
        failures = getattr(x, "failures", None)
        if isinstance(failures, Mapping):
            for f in failures.values():
                todo.extend(v for v in (f if isinstance(f, (list, tuple)) else [f])
                            if isinstance(v, BaseException))
        todo += [x.__cause__, x.__context__]
    return e


@contextmanager
def _interrupt_deferred():
    """Ctrl-C waits until the block is done (main thread only): renaming a checkpoint into place
    and pointing `latest` at it are done whole, not half."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


# ------------------------------------------------------------------------------ checksums


def _checksummed(tmp: Path) -> list[str]:
    """The files of a checkpoint whose checksums tpc.json records: every file but tpc.json."""
    return sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() and p.name != META_FILE)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _gather_checksums(tmp: Path, process_group, distributed: bool, failed: _SaveFailure) -> dict:
    """{file: {"sha256", "size"}} of the shards just written; under torchrun each rank hashes a
    share of the files (they are on one file system) and rank 0 gathers them."""
    names = _checksummed(tmp)
    share, count = (dist.get_rank(process_group), dist.get_world_size(process_group)) if distributed else (0, 1)
    mine: dict | str = {}
    try:
        for name in names[share::count]:
            mine[name] = {"sha256": file_sha256(tmp / name), "size": (tmp / name).stat().st_size}
    except BaseException as e:  # noqa: BLE001 - every rank must reach the gather below
        mine = e if isinstance(e, KeyboardInterrupt) else OSError(getattr(e, "errno", None), str(e))
    parts = [mine]
    if distributed:
        parts = [None] * count
        dist.all_gather_object(parts, mine, group=process_group)
    files: dict = {}
    for part in parts:
        if isinstance(part, BaseException):
            raise failed.translate(part) from None
        files.update(part)
    return files


def verify_files(step_dir: Path, names=None) -> bool:
    """Check the files of `step_dir` (`names`, default all) against the checksums its tpc.json
    records; False when it records none (a checkpoint of an earlier tpc: not verified), True
    when they match; a corrupt-checkpoint error naming the first file that does not."""
    recorded = _recorded_checksums(step_dir)
    if recorded is None:
        return False
    for name in sorted(recorded if names is None else names):
        entry = recorded.get(name)
        if entry is None:
            continue  # a file written after the checksums (none today)
        f = step_dir / name
        if not f.is_file():
            raise _corrupt(step_dir, f"the file {name} is missing")
        size = f.stat().st_size
        if size != entry.get("size", size):
            raise _corrupt(step_dir, f"the file {name} is {size} bytes, {entry['size']} when it was saved "
                                     f"(cut short by a full disk or an interrupted copy?)")
        if file_sha256(f) != entry.get("sha256"):
            raise _corrupt(step_dir, f"the file {name} does not match the checksum recorded when it was "
                                     f"saved (its bytes changed since: a bad disk or copy)")
    return True


def _recorded_checksums(step_dir: Path) -> dict | None:
    try:
        meta = json.loads((step_dir / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # read_meta says what is wrong with it
    files = meta.get("files") if isinstance(meta, dict) else None
    return files if isinstance(files, dict) else None


def is_verified(meta: dict) -> bool:
    """Whether a checkpoint's tpc.json records checksums of its files (loads verify them)."""
    return isinstance(meta.get("files"), dict)


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


def _check_data_files(step_dir: Path, keys) -> list[str]:
    """The data files holding `keys` exist and are as long as the metadata says (a shard cut short
    by a full disk or an interrupted copy is named before anything is read); returns their names."""
    storage = getattr(_read_metadata(step_dir), "storage_data", None)
    if not isinstance(storage, Mapping):
        return []
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
    return sorted(need)


# ------------------------------------------------------------------------------ loading


def load_checkpoint(path: str | os.PathLike, shards_template: dict[str, Any], *, process_group=None,
                    no_dist: bool | None = None) -> dict[str, Any]:
    """Load into `shards_template` in place and return it.

    Tensors in the template receive the stored values (shapes and dtypes must match); plain
    values are replaced. Keys stored but not in the template are ignored, so each process reads
    only what its template names; RNG states the checkpoint lacks (another device kind, another
    rank) are left as they are. A template entry that is not stored, or stored with another
    shape or dtype, is refused before anything is read, and so is a file whose checksum is not
    the one recorded when it was saved (`verify_files`; a checkpoint of an earlier tpc records
    none and loads unverified). `no_dist=True` reads in this process alone even under torchrun
    (every rank reading weights for itself, no collective).
    """
    step_dir = resolve_checkpoint(path)
    read_meta(step_dir)
    _check_structure(shards_template, "")
    verify_files(step_dir, [".metadata"])  # before it is unpickled
    stored = stored_entries(step_dir)
    to_load = _without_missing_optional(shards_template, stored)
    flat = _flatten(to_load)
    _check_against_stored(step_dir, flat, stored)
    verify_files(step_dir, _check_data_files(step_dir, flat))  # the files this process reads
    distributed = is_distributed(process_group) if no_dist is None else not no_dist
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(to_load, checkpoint_id=str(step_dir), process_group=process_group,
                     no_dist=not distributed, planner=load_planner())
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
        elif isinstance(value, (torch.Tensor, Chunks)):
            if not isinstance(entry, TensorStorageMetadata):
                problems.append(f"{key} is stored as a plain value, expected a tensor")
            elif tuple(entry.size) != tuple(value.shape) or entry.properties.dtype != value.dtype:
                # (a `Pieces` entry, part of a sharded optimizer's state, has the whole tensor's shape)
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


def is_distributed(process_group=None) -> bool:
    """Whether a save or load with `process_group` is a collective of several processes."""
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
    aside = step_dir.parent / f"damaged_{step_dir.name}"
    return TpirError(Diagnostic(f"{step_dir}: corrupt checkpoint: {what}",
                                hint=f"set it aside (`mv {step_dir} {aside}`): `latest` then falls back to "
                                     "the newest complete checkpoint before it, which --resume continues "
                                     "from; or give an earlier step directory"))


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
