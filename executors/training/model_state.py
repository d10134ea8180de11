"""A run's state keyed by the unsliced model's names: what a checkpoint holds, for any plan.

Checkpoint format 2, the keys (DCP stores nested dicts under dotted paths):

    params.NAME                     every parameter of the stages, frozen ones too, under its
                                    canonical name (the first name `named_parameters()` gives
                                    a tied weight)
    optim.NAME.KEY                  the optimizer's state of that parameter (AdamW: step,
                                    exp_avg, exp_avg_sq; plain SGD keeps none)
    step                            completed steps
    data.seed, data.next_step, data.source      where the batches continue
    rng.rankG.torch_cpu, rng.rankG.python (, rng.rankG.torch_cuda)   the RNG states of global rank G

A parameter has one key whichever stage, rank or replica holds it: every holder (the ranks of a
tie, the data-parallel replicas) saves it under that key, and DCP writes one copy. A run of any
plan of the same model loads each parameter its stages hold from that key, so the stage split,
the pipeline depth, the replicas, the schedule, the micro-batches and the slices may all differ
from the run that saved: each process reads only its own parameters' entries, nothing is gathered
on one rank. A tie whose stages moved to other ranks is loaded by every rank that holds it now,
so its copies agree again.

Format 1 (written by earlier versions) kept one shard per rank: rankG.params.NAME,
rankG.optim.NAME.KEY, rankG.step, rankG.data.*, rankG.rng.*. It is read through the same
`Layout`: a parameter from the lowest rank that stored it (after a step all copies are equal).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tpc.executors.training import checkpoint
from tpc.executors.training.shard_pieces import Chunks, Pieces
from tpc.ir.diagnostics import Diagnostic, TpirError

_RANK_KEY = re.compile(r"^rank(\d+)\.(params|optim|rng|data|step)(?:\.(.+))?$")


# ------------------------------------------------------------------------------ holders


def engine_parameters(engine) -> list[tuple[str, torch.nn.Parameter]]:
    """Every parameter of the engine's stages (frozen ones too), each tensor once, under the
    stage's (canonical) name, in stage order."""
    seen: set[int] = set()
    out = []
    for s in sorted(engine.stages):
        for name, p in engine.stages[s].named_parameters:
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


@dataclass
class Holder:
    """One copy of a parameter: the tensor and the rank's optimizer that updates it (a
    `RankOptimizer` or a `ShardedOptimizer`; None for a frozen parameter). On a mesh with a
    tensor axis, a parameter cut over it has its `shard` (compiler/tensor ParamShard), and
    `param` is tensor rank `tensor_rank`'s part."""

    param: torch.nn.Parameter
    optimizer: object | None
    shard: object | None = None
    tensor_rank: int = 0


def holders(engines: Sequence) -> dict[str, list[Holder]]:
    """name -> every copy held by `engines` (one per rank holding it), in the engines' order."""
    out: dict[str, list[Holder]] = {}
    for e in engines:
        opt = e.optimizer
        tensor = getattr(e, "tensor", None)
        for name, p in engine_parameters(e):
            shard = tensor.split(name) if tensor is not None else None
            out.setdefault(name, []).append(Holder(p, opt if opt.optimizes(p) else None, shard,
                                                   getattr(e, "tensor_rank", 0)))
    return out


# ------------------------------------------------------------------- tensor-parallel parts


def by_tensor_rank(copies: list[Holder]) -> dict[int, list[Holder]]:
    """The copies of a parameter grouped by tensor rank (one group without a tensor axis):
    the copies of a group hold the same values, those of two groups other parts."""
    out: dict[int, list[Holder]] = {}
    for h in copies:
        out.setdefault(h.tensor_rank if h.shard is not None else 0, []).append(h)
    return out


def tensor_chunks(shard, parts: Mapping[int, torch.Tensor]) -> Chunks:
    """The checkpoint entry of a parameter cut over the tensor axis (or a tensor of its shape:
    an optimizer moment) from the parts of the tensor ranks in `parts` (all of them in the
    interpreter, this process's under torchrun): a rectangle of the whole tensor per segment
    of each part, so a run with another tensor degree reads the overlap it needs."""
    boxes = []
    any_part = next(iter(parts.values()))
    for t, part in sorted(parts.items()):
        at = 0
        for a, b in shard.ranges(t):
            offsets = [0] * part.dim()
            offsets[shard.dim] = a
            sizes = list(part.shape)
            sizes[shard.dim] = b - a
            boxes.append((tuple(offsets), tuple(sizes), part.narrow(shard.dim, at, b - a)))
            at += b - a
    whole = list(any_part.shape)
    whole[shard.dim] = sum(shard.segments)
    return Chunks(tuple(whole), any_part.dtype, boxes)


def _entries(copies: list[Holder]) -> tuple[torch.Tensor | Chunks, dict | None]:
    """(the parameter's checkpoint entry, its optimizer state's) from its copies: the first
    copy's, or for a parameter cut over the tensor axis the parts of every tensor rank present,
    each moment likewise (a plain value, AdamW's step count, from the first)."""
    first = copies[0]
    if first.shard is None:
        return first.param.detach(), _state(copies)
    firsts = {t: group[0] for t, group in by_tensor_rank(copies).items()}
    entry = tensor_chunks(first.shard, {t: h.param.detach() for t, h in firsts.items()})
    if first.optimizer is None:
        return entry, None
    states = {t: h.optimizer.state_of(h.param) or {} for t, h in firsts.items()}
    state = {}
    for field, value in states[min(states)].items():
        if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(first.param.shape):
            state[field] = tensor_chunks(first.shard, {t: st[field] for t, st in states.items()})
        else:
            state[field] = value
    return entry, state or None


def _state(copies: list[Holder]) -> dict | None:
    """The optimizer state of a parameter as this process saves or loads it: the first copy's,
    except that the parts of a sharded state (`Pieces`) of every copy are put together (in the
    interpreter each replica holds its own part; under torchrun a process holds one). None when
    no copy has any state."""
    first = copies[0]
    if first.optimizer is None:
        return None
    state = first.optimizer.state_of(first.param)
    if not first.optimizer.sharded:
        return state
    merged: dict = {}
    for h in copies:
        if h.optimizer is None or not h.optimizer.sharded:
            continue
        for key, value in (h.optimizer.state_of(h.param) or {}).items():
            if isinstance(value, Pieces):
                merged[key] = merged[key].merged(value) if key in merged else value
            else:
                merged.setdefault(key, value)
    return merged or None


# ------------------------------------------------------------------------------ saving


def state_to_save(engines: Sequence, done: int, data: Mapping) -> dict[str, Any]:
    """What `engines` save after `done` steps (format 2). The tensors are the live ones. With
    several engines in one process (the interpreter), a parameter several of them hold is taken
    from the first; under torchrun each process passes its own engine and DCP keeps one copy."""
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict] = {}
    for name, copies in holders(engines).items():
        params[name], state = _entries(copies)
        if state:
            optim[name] = state  # the same tensors (or parts of them)
    return {
        "params": params,
        "optim": optim,
        "step": int(done),
        "data": dict(data),
        "rng": {f"rank{e.global_rank}": checkpoint.rng_state() for e in engines},
    }


# ------------------------------------------------------------------------------ reading


class Layout:
    """Where a checkpoint keeps each part of the state, for either format."""

    def __init__(self, step_dir: Path, meta: Mapping, stored: Mapping[str, Any]):
        self.step_dir, self.format, self.stored = step_dir, meta["format"], stored
        self._params: dict[str, str] = {}
        self._optim: dict[str, dict[str, str]] = {}
        self._rng: dict[int, dict[str, str]] = {}
        self._data: dict[str, str] = {}
        self.step_key: str | None = None
        if self.format == 1:
            self._read_format_1()
        else:
            self._read_format_2()

    def _read_format_2(self) -> None:
        params = sorted((k[len("params."):], k) for k in self.stored if k.startswith("params."))
        self._params = dict(params)
        for key in self.stored:
            if key.startswith("optim."):
                name, field = self._split_state(key[len("optim."):])
                if name is not None:
                    self._optim.setdefault(name, {})[field] = key
            elif key.startswith("rng.rank"):
                rank, _, field = key[len("rng.rank"):].partition(".")
                if rank.isdigit():
                    self._rng.setdefault(int(rank), {})[field] = key
            elif key.startswith("data."):
                self._data[key[len("data."):]] = key
        self.step_key = "step" if "step" in self.stored else None

    def _read_format_1(self) -> None:
        owner: dict[str, int] = {}
        lowest = None
        for key in self.stored:
            m = _RANK_KEY.match(key)
            if m is None:
                continue
            rank, part, rest = int(m.group(1)), m.group(2), m.group(3) or ""
            lowest = rank if lowest is None else min(lowest, rank)
            if part == "params" and (rest not in owner or rank < owner[rest]):
                owner[rest] = rank
            elif part == "rng":
                self._rng.setdefault(rank, {})[rest] = key
        self._params = {name: f"rank{r}.params.{name}" for name, r in sorted(owner.items())}
        for key in self.stored:
            m = _RANK_KEY.match(key)
            if m is not None and m.group(2) == "optim":
                name, field = self._split_state(m.group(3) or "")
                if name is not None and owner.get(name) == int(m.group(1)):
                    self._optim.setdefault(name, {})[field] = key
        if lowest is not None:
            self.step_key = f"rank{lowest}.step" if f"rank{lowest}.step" in self.stored else None
            prefix = f"rank{lowest}.data."
            self._data = {k[len(prefix):]: k for k in self.stored if k.startswith(prefix)}

    @staticmethod
    def _split_state(rest: str) -> tuple[str | None, str]:
        """"NAME.KEY" -> (NAME, KEY): parameter names contain dots, optimizer state keys do not."""
        name, _, field = rest.rpartition(".")
        return (name, field) if name else (None, rest)

    # -------------------------------------------------------------------- queries

    @property
    def names(self) -> list[str]:
        return list(self._params)

    def param_key(self, name: str) -> str | None:
        return self._params.get(name)

    def shape(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        entry = self.stored[self._params[name]]
        return tuple(entry.size), entry.properties.dtype

    def optim_keys(self, name: str) -> dict[str, str]:
        return self._optim.get(name, {})

    def rng_keys(self, rank: int) -> dict[str, str]:
        return self._rng.get(rank, {})

    @property
    def data_keys(self) -> dict[str, str]:
        return self._data

    @property
    def optimizer(self) -> str:
        """The optimizer kind that wrote the state: AdamW keeps exp_avg, plain SGD nothing."""
        return "adamw" if any("exp_avg" in keys for keys in self._optim.values()) else "sgd"


def layout_of(path) -> tuple[Path, dict, Layout]:
    """(step directory, tpc.json, Layout) of a checkpoint (root or step directory)."""
    step_dir = checkpoint.resolve_checkpoint(path)
    meta = checkpoint.read_meta(step_dir)
    return step_dir, meta, Layout(step_dir, meta, checkpoint.stored_entries(step_dir))


@dataclass
class Loaded:
    """What a resume reads besides the tensors: the step, the data position, this process's RNG."""

    step: int
    data: dict
    rng: dict | None


def load_state(step_dir: Path, layout: Layout, engines: Sequence, *, process_group=None) -> Loaded:
    """Load parameters and optimizer state into `engines` in place (each process its own
    engines' entries), and read the step, data position and the RNG of the first engine's rank.
    A parameter several engines hold is read once and copied to the others. Refused, naming
    them, when parameters are missing or stored with another shape or dtype."""
    held = holders(engines)
    _check_params(step_dir, layout, held)
    for e in engines:
        e.optimizer.init_state()  # tensors for the load to fill
    template: dict[str, Any] = {}
    stateless: list[Holder] = []
    scalars: list[tuple[list[Holder], str, torch.Tensor]] = []
    for name, copies in held.items():
        first = copies[0]
        entry, live = _entries(copies)
        template[layout.param_key(name)] = entry
        if first.optimizer is None:
            continue
        live, stored = live or {}, layout.optim_keys(name)
        if not stored:  # the parameter had no gradient before the checkpoint: no state yet
            stateless.extend(copies)
            continue
        if first.optimizer.sharded and not live:
            continue  # no part of this parameter's state is on this process's ranks
        if set(live) != set(stored):
            raise TpirError(Diagnostic(
                f"{step_dir}: the optimizer state of {name} holds {', '.join(sorted(stored))}; this run's "
                f"optimizer keeps {', '.join(sorted(live)) or 'none'}",
                where="--optimizer", hint="resume with the optimizer that wrote the checkpoint"))
        for field, key in stored.items():
            template[key] = live[field]
            if first.optimizer.sharded and not isinstance(live[field], Pieces):
                scalars.append((copies, field, live[field]))  # AdamW's step: to every part
    rng_keys = layout.rng_keys(engines[0].global_rank)
    rng_live = checkpoint.rng_state()
    for field, key in rng_keys.items():
        if field in rng_live:  # a CUDA state is restored only where CUDA runs
            template[key] = rng_live[field]
    for field, key in layout.data_keys.items():
        template[key] = None
    if layout.step_key is None:
        raise checkpoint._corrupt(step_dir, "it records no step")
    template[layout.step_key] = -1
    checkpoint.load_checkpoint(step_dir, template, process_group=process_group)
    with torch.no_grad():
        for name, copies in held.items():
            groups = list(by_tensor_rank(copies).values())
            for group in groups[1:]:  # a plain value of the state (a step count) is read once
                _copy_plain_state(groups[0][0], group[0])
            for group in groups:
                _copy_to_others(group)
        for copies, field, value in scalars:
            for h in copies:
                if h.optimizer is not None and h.optimizer.sharded:
                    h.optimizer.set_field(h.param, field, value)
    for h in stateless:
        if h.optimizer is not None:
            h.optimizer.forget(h.param)
    rng = {field: template[key] for field, key in rng_keys.items() if key in template} or None
    return Loaded(step=template[layout.step_key], data={f: template[k] for f, k in layout.data_keys.items()}, rng=rng)


def _copy_plain_state(source: Holder, target: Holder) -> None:
    """The optimizer state's fields other than tensors of the parameter's shape (AdamW's step
    count), read into `source` (tensor rank 0's part), copied to `target` (another tensor
    rank's part, whose moments were read into it)."""
    if source.optimizer is None or target.optimizer is None:
        return
    theirs = source.optimizer.state_of(source.param) or {}
    mine = target.optimizer.opt.state[target.param]
    for field, value in theirs.items():
        if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(source.param.shape):
            continue
        if isinstance(value, torch.Tensor) and isinstance(mine.get(field), torch.Tensor):
            mine[field].copy_(value)
        else:
            mine[field] = value


def _copy_to_others(copies: list[Holder]) -> None:
    """The weights, and a whole optimizer state, read into the first copy, copied to the others
    (the parts of a sharded state were each read into their own holder)."""
    first = copies[0]
    opt = first.optimizer
    state = (opt.state_of(first.param) or {}) if opt is not None else {}
    if any(isinstance(v, Pieces) for v in state.values()):
        state = {}
    for other in copies[1:]:
        if other.param is first.param:
            continue
        other.param.copy_(first.param)
        opt = other.optimizer
        if opt is not None and state and opt.sharded:
            for field, value in state.items():  # a parameter the sharded optimizer keeps whole
                opt.set_field(other.param, field, value)
        elif opt is not None and state:
            mine = opt.opt.state[other.param]
            for field, value in state.items():
                if isinstance(value, torch.Tensor) and isinstance(mine.get(field), torch.Tensor):
                    mine[field].copy_(value)
                else:
                    mine[field] = value


def _check_params(step_dir: Path, layout: Layout, held: Mapping[str, list[Holder]]) -> None:
    missing, wrong = [], []
    for name, copies in held.items():
        if layout.param_key(name) is None:
            missing.append(name)
            continue
        shape, dtype = layout.shape(name)
        p = copies[0].param
        whole = tuple(tensor_chunks(copies[0].shard, {copies[0].tensor_rank: p}).shape) \
            if copies[0].shard is not None else tuple(p.shape)
        if shape != whole or dtype != p.dtype:
            wrong.append(f"{name}: checkpoint {dtype} {list(shape)}, this run {p.dtype} {list(whole)}")
    if missing or wrong:
        parts = ([f"not in the checkpoint: {listing(missing)}"] if missing else []) + \
                ([f"shapes differ: {listing(wrong, '; ')}"] if wrong else [])
        raise TpirError(Diagnostic(
            f"{step_dir}: the checkpoint does not hold this model's parameters ({' | '.join(parts)})",
            hint="resume with a plan of the model that wrote the checkpoint"))


def read_params(step_dir: Path, layout: Layout, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Parameters `names` (default: all stored) as new tensors, read by this process alone
    (no collective: every rank of a run may read its own)."""
    names = list(layout.names if names is None else names)
    template = {}
    for name in names:
        shape, dtype = layout.shape(name)
        template[layout.param_key(name)] = torch.empty(shape, dtype=dtype)
    checkpoint.load_checkpoint(step_dir, template, no_dist=True)
    return {name: template[layout.param_key(name)] for name in names}


def listing(items: Sequence[str], sep: str = ", ", show: int = 4) -> str:
    """The first few items and how many more."""
    more = f"{sep}... ({len(items) - show} more)" if len(items) > show else ""
    return sep.join(items[:show]) + more
