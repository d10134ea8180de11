"""A stage's programs compiled with torch.compile (inductor): fused kernels, one call a program.

Each program is an aten graph of one slice shape (`joint.py`), so it is compiled with static
shapes: no guard on a size can fail, and every shape the plan runs is compiled before step 1
(`StagePrograms.prepare`). Dynamic shapes would make one program serve every prefix length,
but the graphs specialise masks and positions to their slice, so they would not be one
program; see docs/compile.md for the measurement that chose static shapes.

The cache: inductor keeps what it compiled on disk, keyed by the graph, the input layouts,
torch's version and the device, so a second run of a plan compiles nothing it compiled before.
It lives in `TORCHINDUCTOR_CACHE_DIR` (default: a folder under the system's temporary
directory, `/tmp/torchinductor_<user>`); an entry is invalid, and recompiled, when any of what
keys it changes: another torch or device never reads a stale program.
"""

from __future__ import annotations

import dataclasses

import torch

from tpc.compiler.programs.joint import Programs

def cache_dir() -> str:
    """Where inductor keeps what it compiled (TORCHINDUCTOR_CACHE_DIR, or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return inductor_cache_dir()


# the inductor settings of every program: its inputs' sizes and strides are the plan's (`Shape`),
# so the wrapper's per-call checks of them are left out
OPTIONS = {"size_asserts": False}

NAMES = ("forward", "backward", "backward_input", "backward_weight")


class CompiledProgram:
    """One program compiled by inductor for its static shapes, the whole graph at once, at its
    first call (whose inputs are the examples inductor needs). The graph is aten already, so
    it goes to inductor directly (`torch._inductor.compile`), with no Python frame to capture."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.fn = None

    def __call__(self, *args):
        if self.fn is None:
            from torch._guards import TracingContext, tracing
            from torch._inductor import compile as inductor_compile
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            from tpc.compiler.programs.joint import TRACING

            # a tracing context with a shape environment (static: no symbol is made), which
            # inductor's on-disk graph cache needs to key and reuse a compilation; one
            # compilation at a time in a process (inductor traces, as make_fx does), and
            # compiling runs nothing of the program, so no collective waits meanwhile
            with TRACING, tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):
                self.fn = inductor_compile(self.gm, list(args), options=OPTIONS)
        return self.fn(*args)


def compile_programs(progs: Programs) -> Programs:
    """`progs` with every program compiled (lazily: inductor compiles a program at its first
    call, which `StagePrograms.prepare` makes before step 1)."""
    made = {name: CompiledProgram(getattr(progs, name)) for name in NAMES if getattr(progs, name) is not None}
    return dataclasses.replace(progs, **made)
