"""The sequence-length curriculum of DeepSpeed Data Efficiency, over a plan bundle.

`tpc run PLANS --curriculum SPEC` trains with short sequences first: each step's length comes
from DeepSpeed's curriculum scheduler (deepspeed/runtime/data_pipeline/curriculum_scheduler.py),
rounded down to the lengths the bundle has plans for, and the step runs that length's plan. The
plans share one stage split (ir/verify/bundle.py), so switching changes only which instruction
stream runs: the same processes, process groups, parameters and optimizer state.

The schedules, as DeepSpeed defines them (`global_steps` counts from 1: DeepSpeed's engine asks
for the difficulty of `global_steps + 1` before step `global_steps`, so step s of ours, counting
from 0, gets the difficulty of s + 1):

    fixed_linear:START:END:STEPS          d(g) = floor((g / STEPS) * (END - START) + START)
    fixed_root:START:END:STEPS[:DEGREE]   d(g) = floor((g / STEPS) ** (1 / DEGREE) * (END - START) + START)
                                          (DEGREE 2 by default)
        then d -= d % 8 (DeepSpeed's difficulty_step: a multiple of 8), and d = min(d, END)
    fixed_discrete:L1,L2,...:S1,S2,...    L1 while g <= S1, L2 while g <= S2, ..., the last L after

and, as DeepSpeed's `update_difficulty`, once the difficulty has reached END it stays there.
The length of a step is the longest length of the bundle that is <= d. START and END (and
every Li) must be lengths of the bundle, and multiples of 8 for the root schedules.

The data (DeepSpeed's `curriculum_type`): each step's batch is drawn at the full length END, as
it would be without a curriculum, then
    seqlen_truncate   keeps the first L tokens of each sequence (fewer tokens per step);
    seqlen_reshape    cuts each sequence into END / L sequences of L tokens (the same tokens per
                      step, more sequences: the bundle's plans must have batch x L constant,
                      `tpc compile --constant-tokens`).
A batch source gives (rows, seq + 1) tokens (ids and next-token targets, executors/training/
batches.py): truncation keeps tokens [0, L + 1); reshaping takes the windows [cL, (c+1)L + 1)
of each row, c = 0 .. END/L - 1, which are exactly the ids and targets reshaped.

A step's length, batch and learning rate are functions of the step alone, so a checkpoint's step
is its curriculum position; the checkpoint also records the curriculum, and a resume under
another curriculum is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tpc.ir.diagnostics import Diagnostic, TpirError

KINDS = ("fixed_linear", "fixed_root", "fixed_discrete")
DATA_TYPES = ("seqlen_truncate", "seqlen_reshape")
DIFFICULTY_STEP = 8  # DeepSpeed's difficulty_step: lengths a multiple of 8 (tensor cores)

_FORMS = ("fixed_linear:START:END:STEPS, fixed_root:START:END:STEPS[:DEGREE] or "
          "fixed_discrete:L1,L2,...:S1,S2,... (e.g. fixed_linear:64:512:1000)")


def _refuse(message: str, hint: str, flag: str = "--curriculum") -> TpirError:
    return TpirError(Diagnostic(message, where=flag, hint=hint))


@dataclass(frozen=True)
class Curriculum:
    """One of DeepSpeed's fixed schedules (module docstring). `spec` is how it was written."""

    kind: str
    start: int  # DeepSpeed's min_difficulty
    end: int  # max_difficulty
    total_steps: int = 1  # total_curriculum_step (linear, root)
    root_degree: int = 2
    difficulties: tuple[int, ...] = ()  # fixed_discrete
    max_steps: tuple[int, ...] = ()
    difficulty_step: int = DIFFICULTY_STEP
    spec: str = ""
    _seen: list = field(default_factory=list, compare=False, repr=False)  # difficulty per step

    def deepspeed_difficulty(self, global_steps: int) -> int:
        """DeepSpeed's `get_difficulty(global_steps)`."""
        if self.kind == "fixed_discrete":
            if global_steps > self.max_steps[-1]:
                return self.difficulties[-1]
            for d, s in zip(self.difficulties, self.max_steps):
                if global_steps <= s:
                    return d
        degree = 1 if self.kind == "fixed_linear" else self.root_degree
        d = (float(global_steps) / self.total_steps) ** (1.0 / degree)
        d = math.floor(d * (self.end - self.start) + self.start)
        d -= d % self.difficulty_step
        return min(d, self.end)

    def difficulty(self, step: int) -> int:
        """The difficulty (sequence length) DeepSpeed's `update_difficulty` gives training step
        `step` (counting from 0): it starts at START, is updated with `step + 1` before each
        step, and stays once it has reached END."""
        seen = self._seen
        current = seen[-1] if seen else self.start
        while len(seen) <= step:
            if current < self.end:
                current = self.deepspeed_difficulty(len(seen) + 1)
            seen.append(current)
        return seen[step]

    def length(self, step: int, lengths: tuple[int, ...]) -> int:
        """The step's length, rounded down to the bundle's `lengths` (the shortest when the
        difficulty is below all of them, which `check_curriculum` rules out)."""
        d = self.difficulty(step)
        fitting = [l for l in lengths if l <= d]
        return max(fitting) if fitting else min(lengths)

    def lengths_used(self, lengths: tuple[int, ...]) -> tuple[int, ...]:
        """The bundle lengths a run can take: between START and END, or the discrete ones."""
        if self.kind == "fixed_discrete":
            return tuple(sorted(set(self.difficulties)))
        return tuple(l for l in lengths if self.start <= l <= self.end)

    def asks_for(self) -> tuple[int, ...]:
        """The lengths this curriculum names, which the bundle must have."""
        if self.kind == "fixed_discrete":
            return tuple(dict.fromkeys(self.difficulties))
        return (self.start, self.end)


def parse_curriculum(spec: str) -> Curriculum:
    """`--curriculum KIND:...` (module docstring); every mistake names the flag."""
    parts = str(spec).strip().split(":")
    kind = parts[0]
    if kind not in KINDS:
        raise _refuse(f"--curriculum {spec!r}: unknown schedule {kind!r}", f"write {_FORMS}")

    def numbers(text: str, what: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise _refuse(f"--curriculum {spec!r}: {what} {text!r} is not a whole number"
                          + ("" if "," not in text else " list"), f"write {_FORMS}") from None
        if any(v < 1 for v in values):
            raise _refuse(f"--curriculum {spec!r}: {what} must be >= 1", f"write {_FORMS}")
        return values

    if kind == "fixed_discrete":
        if len(parts) != 3:
            raise _refuse(f"--curriculum {spec!r}: fixed_discrete takes lengths and the steps "
                          "they last", "e.g. fixed_discrete:64,128,256:100,200 (64 for steps 1-100, "
                          "128 to step 200, then 256)")
        lengths, steps = numbers(parts[1], "a length"), numbers(parts[2], "a step")
        if len(steps) != len(lengths) - 1:
            raise _refuse(f"--curriculum {spec!r}: {len(lengths)} lengths need {len(lengths) - 1} "
                          f"max steps (the last length lasts to the end), got {len(steps)}",
                          "e.g. fixed_discrete:64,128,256:100,200")
        if steps != sorted(steps):
            raise _refuse(f"--curriculum {spec!r}: the max steps must increase", "e.g. 100,200")
        top = lengths.index(max(lengths))
        never = [l for l in lengths[top + 1:] if l < lengths[top]]
        if never:
            # DeepSpeed's update_difficulty stops once it reaches max_difficulty (the longest
            # length): a length after that would never run, and the schedule would silently
            # differ from what it says
            raise _refuse(f"--curriculum {spec!r}: {', '.join(map(str, never))} come(s) after the longest "
                          f"length {lengths[top]}, and the curriculum stays at the longest once it gets "
                          "there: it would never run", "put the longest length last, e.g. "
                          f"fixed_discrete:{','.join(map(str, [*lengths[:top], *never, lengths[top]]))}:"
                          f"{','.join(map(str, steps))}")
        if not steps:
            raise _refuse(f"--curriculum {spec!r}: fixed_discrete needs two lengths or more",
                          "e.g. fixed_discrete:64,128:100")
        return Curriculum(kind, start=lengths[0], end=max(lengths), difficulties=tuple(lengths),
                          max_steps=tuple(steps), spec=spec)
    want = 4 if kind == "fixed_linear" else (4, 5)
    if len(parts) not in ((want,) if isinstance(want, int) else want):
        raise _refuse(f"--curriculum {spec!r}: {kind} takes START:END:STEPS"
                      + ("" if kind == "fixed_linear" else "[:DEGREE]"), f"write {_FORMS}")
    start, end, steps = (numbers(p, w)[0] for p, w in zip(parts[1:4], ("START", "END", "STEPS")))
    degree = numbers(parts[4], "DEGREE")[0] if len(parts) == 5 else 2
    if start >= end:
        raise _refuse(f"--curriculum {spec!r}: START {start} must be below END {end}",
                      "the curriculum goes from short sequences to long ones")
    for name, v in (("START", start), ("END", end)):
        if v % DIFFICULTY_STEP:
            raise _refuse(f"--curriculum {spec!r}: {name} {v} is not a multiple of {DIFFICULTY_STEP}",
                          f"DeepSpeed rounds every length down to a multiple of {DIFFICULTY_STEP} "
                          f"(its difficulty_step): use {v - v % DIFFICULTY_STEP or DIFFICULTY_STEP}")
    return Curriculum(kind, start=start, end=end, total_steps=steps, root_degree=degree, spec=spec)


def check_curriculum(curriculum: Curriculum, bundle, data_type: str) -> None:
    """Refuse, before any communication, a curriculum whose lengths the bundle (a
    `tpc.ir.verify.bundle.LoadedBundle`) lacks, or plans whose batches do not fit `data_type`;
    located at the bundle's index."""
    index = bundle.index
    lengths = bundle.lengths
    last = index.members[-1]
    have = ", ".join(map(str, lengths))
    for seq in curriculum.asks_for():
        if seq not in lengths:
            raise TpirError(Diagnostic(
                f"--curriculum {curriculum.spec}: asks for length {seq}, and the bundle has plans of "
                f"lengths {have} only", loc=last.loc, where=index.source,
                hint=f"recompile the bundle with {seq} among --seq-len, or use its lengths in "
                     "--curriculum"))
    if data_type not in DATA_TYPES:
        raise _refuse(f"unknown --curriculum-type {data_type!r}", f"use one of: {', '.join(DATA_TYPES)}",
                      "--curriculum-type")
    used = curriculum.lengths_used(lengths)
    full = bundle.plan(curriculum.end).header.shape
    for seq in used:
        member = index.member(seq)
        if data_type == "seqlen_truncate" and member.batch != full.batch:
            raise TpirError(Diagnostic(
                f"--curriculum-type seqlen_truncate keeps the batch ({full.batch} sequences at length "
                f"{curriculum.end}), and the plan of length {seq} has batch {member.batch}",
                loc=member.loc, where=index.source,
                hint="recompile the bundle without --constant-tokens, or run with "
                     "--curriculum-type seqlen_reshape"))
        if data_type == "seqlen_reshape" and (curriculum.end % seq or member.batch * seq != full.batch * curriculum.end):
            raise TpirError(Diagnostic(
                f"--curriculum-type seqlen_reshape cuts each sequence of {curriculum.end} tokens into "
                f"sequences of {seq}, {full.batch} x {curriculum.end} / {seq} of them, and the plan of "
                f"length {seq} has batch {member.batch}",
                loc=member.loc, where=index.source,
                hint="recompile the bundle with --constant-tokens (lengths dividing the longest), or "
                     "run with --curriculum-type seqlen_truncate"))


class CurriculumBatches:
    """`get(step)`: the step's tokens at its curriculum length, from `full` (a batch source at
    length END, executors/training/batches.py), truncated or reshaped (module docstring)."""

    def __init__(self, full, curriculum: Curriculum, lengths: tuple[int, ...], data_type: str):
        self.full, self.curriculum, self.lengths, self.data_type = full, curriculum, lengths, data_type

    def length(self, step: int) -> int:
        return self.curriculum.length(step, self.lengths)

    def get(self, step: int) -> torch.Tensor:
        return shape_batch(self.full.get(step), self.length(step), self.data_type)


def shape_batch(tokens: torch.Tensor, seq: int, data_type: str) -> torch.Tensor:
    """(rows, END + 1) tokens as the step of length `seq` takes them (module docstring)."""
    end = tokens.shape[1] - 1
    if data_type == "seqlen_truncate" or seq == end:
        return tokens[:, : seq + 1]
    windows = [tokens[:, c * seq: (c + 1) * seq + 1] for c in range(end // seq)]
    return torch.stack(windows, dim=1).reshape(-1, seq + 1)  # row b's windows in order
