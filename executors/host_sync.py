"""Where a step may wait for the device: the one read of its loss and gradient norm.

DESIGN.md section 9: the host never waits for the device inside a step except where the plan
says, once per step, to read the step's loss and its gradient norm. A read of a device value (a
`.item()`, `float(t)`, `if t:`) waits for every kernel queued before it; one in the middle of a
step leaves the GPU idle while the host catches up, and one per micro-batch or slice does so
many times a step.

Three parts:

- `watched(what)` marks a region that must not wait for the device except through `read`: the
  training loop (executors/training_loop.py) wraps each step (from running the plan to the
  step's report; a checkpoint due after it is outside) and each evaluation in it.
- `read(values, what)` is the one way executor code reads device values: every tensor of
  `values` in one device-to-host transfer (stacked, so one wait however many there are), plain
  numbers passed through. The executors call it once per step (the loss and gradient norm of
  every engine of the process) and once per evaluation (its batches' losses). `allowed(what)`
  marks any other read as deliberate (none in a step).
- `HostSyncMonitor`, a `TorchDispatchMode` that records every host-syncing call made outside
  `read` and `allowed` (with `watched_only`, only those inside `watched` regions), each with the
  Python line that made it, and every `read`. The tests
  (tests/executors/test_host_sync.py) run whole training steps under it on the CPU and fail on
  any recorded sync.

What the monitor sees. The aten ops that read a value on the host or whose output shape depends
on the data (so the host must wait for it): `_local_scalar_dense` (what `.item()`, `float(t)`,
`int(t)`, `bool(t)`, `if t:`, `math.isfinite(t)` and f-string formatting of a tensor call),
`is_nonzero`, `equal`, `nonzero`, `masked_select`, the `unique` family, `bincount`,
`repeat_interleave` of a tensor of counts without `output_size`, and `index` / `index_put_`
with a boolean mask (they run `nonzero`). And, by wrapping the methods while it is active,
`Tensor.tolist()`, `Tensor.numpy()` and `Tensor.cpu()` (which on CPU tensors never reach the
dispatcher).

What it cannot see on the CPU. A copy between devices: with every tensor on the CPU there is
none (`.to("cpu")`, `.to(device)` and `copy_` stay on the CPU, most of them without reaching the
dispatcher), so a device-to-host copy (`.to("cpu")` of a GPU tensor) goes unseen, and so does a
host-to-device copy from pageable memory, which on CUDA waits for the stream too (`.to(device)`
without `non_blocking`). Explicit `torch.cuda.synchronize()` calls (the engine makes one per
instruction when tracing, on purpose: the trace's times need it). And anything another thread
does (the mode is per thread: the distributed executor's watchdog and gloo send threads are not
watched). On a GPU, `torch.cuda.set_sync_debug_mode("error")` catches the copies.

Reads of host tensors that exist on any device are not device syncs and are not recorded:
torch.optim keeps each parameter's step count as a CPU tensor (unless `capturable` or `fused`)
and reads it with `.item()` (`torch.optim.optimizer._get_value`).
"""

from __future__ import annotations

import threading
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_state = threading.local()  # .allowed: what the current thread may read now; .watched: where it is
_monitors: list["HostSyncMonitor"] = []  # active monitors (each records its own thread only)


@contextmanager
def _pushed(name: str, what: str) -> Iterator[None]:
    stack = getattr(_state, name, None)
    if stack is None:
        stack = []
        setattr(_state, name, stack)
    stack.append(what)
    try:
        yield
    finally:
        stack.pop()


def watched(what: str):
    """A region (a step, an evaluation: `what` names it) that reads the device only by `read`."""
    return _pushed("watched", what)


def allowed(what: str):
    """A deliberate read of the device (`what` says which): not recorded as a sync."""
    return _pushed("allowed", what)


def _allowed_now() -> bool:
    return bool(getattr(_state, "allowed", None))


def _region() -> str | None:
    stack = getattr(_state, "watched", None)
    return stack[-1] if stack else None


def read(values: Sequence["torch.Tensor | float | int | None"], what: str) -> list:
    """Every value as a Python number, the tensors (each one element) read in one transfer:
    the step's one wait for the device. Plain numbers and None pass through; the tensors must
    share a device. Exact: a float64 value comes back as the same float."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    for m in _monitors:
        m._note_read(what)
    if not tensors:
        return list(values)
    with allowed(what):
        dtype = torch.float64 if any(t.is_floating_point() for t in tensors) else tensors[0].dtype
        got = iter(torch.stack([t.detach().reshape(()).to(dtype) for t in tensors]).tolist())
    return [next(got) if isinstance(v, torch.Tensor) else v for v in values]


# ------------------------------------------------------------------------------ the monitor

_aten = torch.ops.aten
# ops that read a device value on the host, or whose output's shape depends on the data
_SYNCING = {
    _aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default,
    _aten.nonzero.default, _aten.nonzero.out, _aten.masked_select.default,
    _aten._unique.default, _aten._unique2.default, _aten.unique_dim.default,
    _aten.unique_consecutive.default, _aten.bincount.default,
}
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
             _aten._index_put_impl_.default}
_METHODS = ("tolist", "numpy", "cpu")

_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)


@dataclass(frozen=True)
class Sync:
    """One recorded host sync: the op (or method), the innermost line outside torch that made
    it, the stack of lines outside torch (innermost last), and the watched region it was in."""

    op: str
    where: str
    stack: tuple[str, ...]
    region: str | None = None

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


def _host_read(stack: list[traceback.FrameSummary]) -> bool:
    """A read of a tensor that lives on the host on every device (the module docstring)."""
    return any(f.name == "_get_value" and f.filename.startswith(_TORCH) and "optim" in f.filename
               for f in stack[-4:])


class HostSyncMonitor(TorchDispatchMode):
    """Records the host syncs of the thread that enters it outside `read` and `allowed`
    (`syncs`; with `watched_only`, only those inside a `watched` region) and the `read`s
    (`reads`: (region, what) of each). `report()` says where each sync was."""

    def __init__(self, watched_only: bool = False):
        super().__init__()
        self.watched_only = watched_only
        self.syncs: list[Sync] = []
        self.reads: list[tuple[str | None, str]] = []
        self._thread = None
        self._saved: dict[str, object] = {}

    # -- entering and leaving: the dispatch mode, and the wrapped methods

    def __enter__(self):
        self._thread = threading.get_ident()
        _monitors.append(self)
        for name in _METHODS:  # (on torch.Tensor itself, or inherited from its C base)
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._saved.items():
                if original is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, original)
            self._saved.clear()
            _monitors.remove(self)

    def _wrap(self, name: str, original):
        monitor = self

        def method(tensor, *args, **kwargs):
            monitor._record(f"Tensor.{name}()")
            return original(tensor, *args, **kwargs)

        method.__name__ = name
        return method

    def _note_read(self, what: str) -> None:
        if threading.get_ident() == self._thread:
            self.reads.append((_region(), what))

    # -- recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCING:
            self._record(str(func))
        elif func in _INDEXING and _has_mask(args[1] if len(args) > 1 else kwargs.get("indices")):
            self._record(f"{func} with a boolean mask")
        elif func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self._record(str(func))
        return func(*args, **kwargs)

    def _record(self, op: str) -> None:
        if threading.get_ident() != self._thread or _allowed_now():
            return
        region = _region()
        if self.watched_only and region is None:
            return
        frames = traceback.extract_stack()[:-2]
        if _host_read(frames):
            return
        mine = [f for f in frames if not f.filename.startswith(_TORCH) and f.filename != _HERE]
        lines = tuple(f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in mine)
        self.syncs.append(Sync(op, lines[-1] if lines else "(inside torch)", lines[-8:], region))

    def report(self) -> str:
        """Every recorded sync with its line, then the lines that led to the first one."""
        if not self.syncs:
            return "no host sync"
        regions = sorted({s.region for s in self.syncs if s.region is not None})
        out = [f"{len(self.syncs)} host sync(s) outside the step's one read"
               + (f" (in {', '.join(regions[:3])}{', ...' if len(regions) > 3 else ''})" if regions else "") + ":"]
        seen: dict[str, int] = {}
        for s in self.syncs:
            seen[str(s)] = seen.get(str(s), 0) + 1
        out += [f"  {where} ({n}x)" for where, n in seen.items()]
        out.append("the first one was reached through:")
        out += [f"    {line}" for line in self.syncs[0].stack]
        return "\n".join(out)


def _has_mask(indices) -> bool:
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
