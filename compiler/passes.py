"""The pass manager of `tpc compile`: a compile is a list of small named passes run by one driver.

Modelled on xdsl-opt and mlir-opt. A pass is a small object with a `name`, a one-line `summary`,
its options as fields, and `run(state, note) -> state`: it reads a `CompileState` (frozen) and
returns a new one with what it made (`state.but(...)`); `note(text)` adds to its progress line.
The driver, `PassManager.run`:

- runs the passes in order, one progress line each (`  lower   0.12s  1234 instructions`);
- verifies the plan (ir/verify, under the compile's communication rules) after every pass that
  makes or changes one (`changes_plan`), so no pass hands on an unverified plan
  (DESIGN.md, section 2), and says so in a line of its own (`  verify  0.02s  lower's plan...`);
- prints the IR after the passes named in `print_after` ("all": every pass), in canonical form
  (ir/printer.py), each dump a `.tpir` text `parse` reads, under a `# after PASS` comment:
  the plan once there is one; before that the compute order with its header (a plan with no
  communication yet: it parses, and the verifier would refuse it); before that the header alone
  (a plan with no rank sections); before a header, only the comment (there is no IR yet).

Nothing here knows torch: the passes import what they run when they run.
"""

from __future__ import annotations

import dataclasses
import sys
from abc import ABC, abstractmethod
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence, TextIO

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header, Instr, Microbatch, Plan
from tpc.ir.semantics import DEFAULT_COMM, CommRules

ALL = "all"  # `--print-after all`: after every pass


@dataclass(frozen=True)
class CompileState:
    """What the passes have made so far. Frozen: a pass returns a new state (`but`)."""

    model_path: str
    factory: str = "model"
    # the model file: its module (load), content hash and vocabulary
    model: Any = None
    sha256: str | None = None
    vocab: int | None = None
    # the front end's SlicedModel (trace): units, their labels and ties, the numeric self-check
    sliced: Any = None
    # cost models for any stage partition (a CostSource), with --cost or --device-model
    source: Any = None
    ranges: tuple[tuple[int, int], ...] | None = None  # the stages' unit ranges (partition)
    header: Header | None = None
    eval_microbatches: tuple[Microbatch, ...] | None = None  # the evaluation's, when its own
    compute: Mapping[int, Sequence[Instr]] | None = None  # each rank's compute order (schedule)
    plan: Plan | None = None

    def but(self, **changes) -> "CompileState":
        return dataclasses.replace(self, **changes)


class Pass(ABC):
    """One step of a compile. Subclasses set `name` and `summary`, hold their options as
    fields (dataclasses), and define `run`. `changes_plan`: the pass makes or changes
    `state.plan`, which the driver then verifies."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    changes_plan: ClassVar[bool] = False

    @abstractmethod
    def run(self, state: CompileState, note: Callable[[str], None]) -> CompileState:
        """The state after this pass; `note(text)` adds to the pass's progress line."""


def ir_text(state: CompileState) -> str | None:
    """The IR a state holds, in canonical form (see the module docstring); None before a header."""
    from tpc.ir.printer import print_plan

    if state.plan is not None:
        return print_plan(state.plan)
    if state.header is None:
        return None
    if state.compute is not None:
        from tpc.compiler.lowering.lower import to_plan

        return print_plan(to_plan(state.header, {r: tuple(v) for r, v in state.compute.items()}))
    return print_plan(Plan(header=state.header, ranks=()))


def dump(pass_name: str, state: CompileState) -> str:
    """`# after PASS` and the IR of `state` (`ir_text`): one dump of `--print-after`."""
    text = ir_text(state)
    if text is None:
        return f"# after {pass_name}: no IR yet (the header comes with the stages)\n"
    return f"# after {pass_name}\n{text}"


class Progress:
    """Short progress lines with timings on stderr (stdout keeps the summary and the dumps)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class PassManager:
    """Runs `passes` in order (the module docstring). `print_after` names passes of this list,
    or "all"; a name not in it is refused, listing the valid ones, before anything runs.
    `known`: every pass name of the command, for that message (defaults to this list's)."""

    passes: tuple[Pass, ...]
    comm: CommRules = DEFAULT_COMM
    print_after: tuple[str, ...] = ()
    quiet: bool = False
    known: tuple[str, ...] = ()
    out: TextIO | None = None  # where the dumps go (default: stdout)

    def __post_init__(self):
        object.__setattr__(self, "comm", CommRules.of(self.comm))
        names = self.names
        for name in self.print_after:
            if name != ALL and name not in names:
                known = self.known or names
                where = ("" if name not in known else
                         f": this compile runs {', '.join(names)} ({name!r} runs with other options)")
                raise TpirError(Diagnostic(
                    f"--print-after {name}: no such pass{where}",
                    hint=f"choose among {', '.join(names)}, or {ALL}", where="--print-after"))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    def run(self, state: CompileState) -> CompileState:
        from tpc.ir.verify import check

        progress = Progress(self.quiet)
        every = ALL in self.print_after
        for p in self.passes:
            detail: list[str] = []
            start = time.perf_counter()
            state = p.run(state, detail.append)
            progress.say(f"  {p.name:<10} {time.perf_counter() - start:6.2f}s  {' '.join(detail)}".rstrip())
            if p.changes_plan and state.plan is not None:
                start = time.perf_counter()
                check(state.plan, self.comm)
                progress.say(f"  {'verify':<10} {time.perf_counter() - start:6.2f}s  "
                             f"{p.name}'s plan, under {self.comm}'s rules")
            if every or p.name in self.print_after:
                out = self.out or sys.stdout
                out.write(dump(p.name, state))
                out.flush()
        return state
