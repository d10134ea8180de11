"""`StagePrograms`: one stage's programs, by slice shape, derived once each and kept.

The stage runtime asks for the programs of a slice's `Shape` (`get`); the first ask derives
them from the joint graph (`joint.py`) and, with `compile` set, compiles them (`compiled.py`).
`prepare` derives every shape of a plan before step 1 (`shapes_of_plan`), with a progress line,
so a step never waits for a trace or a compilation.
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tpc.compiler.programs.joint import Programs, Shape, derive, state_of


# programs derived in this process, by stage signature and shape: every rank's copy of a stage
# (the interpreter's), every run of one model, shares them (oldest dropped past _KEEP)
_DERIVED: collections.OrderedDict = collections.OrderedDict()
_KEEP = 512


@dataclass(frozen=True)
class ProgramOptions:
    """How a stage's programs run: `compile` them with torch.compile (inductor), or run the
    traced graphs as they are."""

    compile: bool = False


class StagePrograms:
    """The programs of one stage (a StageModule), one set per slice shape."""

    def __init__(self, module, options: ProgramOptions = ProgramOptions()):
        self.module = module
        self.options = options
        self._by_shape: dict[Shape, Programs] = {}
        self._sig: tuple | None = None
        self._state: list | None = None
        self._trainable: list | None = None
        # set once every shape of the plan is prepared: a shape met later is one the plan does
        # not have, compiled apart (never run by another shape's program) and said
        self.sealed = False

    def state(self) -> list[torch.Tensor]:
        """The stage's parameters and buffers, in the order every program takes them. Read once:
        they are the same tensors for the stage's life (updates are in place, and the optimizer
        holds the same objects)."""
        if self._state is None:
            names, state, trainable = state_of(self.module)
            self._state, self._trainable = state, [state[i] for i in trainable]
        return self._state

    def trainable(self) -> list[torch.Tensor]:
        self.state()
        return self._trainable

    def get(self, shape: Shape, x: torch.Tensor, prefix: list, targets) -> Programs:
        """The programs of `shape`, derived now if this is its first slice (`x`, `prefix` and
        `targets` are a slice of it)."""
        progs = self._by_shape.get(shape)
        if progs is None:
            key = (self._signature(), shape, targets is not None, self.options)
            progs = _DERIVED.get(key)
            if self.sealed and self.options.compile:
                print(f"tpc: stage {self.module.lo}:{self.module.hi}: a slice of {shape.describe()} is not one "
                      "the plan prepared; compiling its programs now", file=sys.stderr)
            if progs is None:
                progs = derive(self.module, shape, x, prefix, targets)
                if self.options.compile:
                    from tpc.compiler.programs.compiled import compile_programs

                    progs = compile_programs(progs)
                _DERIVED[key] = progs
                while len(_DERIVED) > _KEEP:
                    _DERIVED.popitem(last=False)
            self._by_shape[shape] = progs
        return progs

    def _signature(self) -> tuple:
        """What a stage's programs depend on besides the slice's shape: its graph's code and
        the names, shapes, dtypes and trainability of what it reads (the values are the
        programs' inputs, never part of them)."""
        if self._sig is None:
            params = {id(p) for p in self.module.parameters()}
            names, state, trainable = state_of(self.module)
            self._sig = (self.module.code, self.module.is_first, self.module.is_last, tuple(trainable),
                         tuple((n, tuple(t.shape), t.dtype, id(t) in params) for n, t in zip(names, state)))
        return self._sig

    @property
    def shapes(self) -> list[Shape]:
        return list(self._by_shape)

    def prepare(self, examples: list[tuple[Shape, Callable[[], tuple]]],
                progress: Callable[[str], None] | None = None) -> float:
        """Derive (and compile) the programs of every shape in `examples` ((shape, a function
        making an example slice (x, prefix, targets) of it)) now; returns the seconds taken."""
        start = time.perf_counter()
        todo = [(s, make) for s, make in examples if s not in self._by_shape]
        for k, (shape, make) in enumerate(todo):
            if progress is not None:
                progress(f"stage {self.module.lo}:{self.module.hi}: programs {k + 1}/{len(todo)} "
                         f"({shape.describe()})")
            self.get(shape, *make())
        return time.perf_counter() - start
