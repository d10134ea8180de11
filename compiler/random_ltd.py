"""Random layerwise token dropping (random-LTD, DeepSpeed Data Efficiency): which tokens each
dropped unit keeps, drawn so that every rank can draw them alone.

`RandomLTD` holds the units that drop tokens (the middle Transformer blocks a user names) and
DeepSpeed's kept-count schedule, with DeepSpeed's config names (`random_ltd_schedule`):
`min_value`, `max_value`, `schedule_type` ("fixed_linear", the one DeepSpeed has) and its
`schedule_config`'s `require_steps` and `seq_per_step`. At step s the kept count is

    floor(s / require_steps * (max_value - min_value) + min_value), rounded down to a multiple
    of seq_per_step, at most max_value

(DeepSpeed's `RandomLTDScheduler`, `fixed_linear`: root degree 1).

The kept tokens: per (step, data replica, micro-batch, unit, token slice), a sorted random
subset of the slice's positions, from a generator seeded by those numbers and the run's seed
(`keep`), so no rank waits for another's draw and the oracle draws the same. A slice keeps its
own share of the count: with slices ending at e_1 < ... < e_n = L, slice i keeps
floor(k e_i / L) - floor(k e_{i-1} / L) of its tokens, at least 1 and at most all of them; an
unsliced micro-batch keeps k. All rows of a micro-batch keep the same positions (DeepSpeed draws
per sequence; one subset per micro-batch keeps the kept tokens a rectangle, so position tables
shared by the rows are gathered once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tpc.ir.diagnostics import Diagnostic, TpirError

SCHEDULE_TYPES = ("fixed_linear",)
_MIX = 1_000_003  # a prime: folds the draw's coordinates into one seed


@dataclass(frozen=True)
class RandomLTD:
    units: tuple[int, ...]  # the units that drop tokens
    min_value: int  # kept tokens per sequence at step 0
    max_value: int  # kept tokens per sequence at the end of the schedule
    require_steps: int  # steps from min_value to max_value
    seq_per_step: int = 1  # the kept count is a multiple of it (DeepSpeed: 16)
    schedule_type: str = "fixed_linear"
    seed: int = 1234

    def __post_init__(self):
        if self.schedule_type not in SCHEDULE_TYPES:
            raise TpirError(Diagnostic(f"random-LTD schedule type {self.schedule_type!r} is not known",
                                       where="random_ltd_schedule.schedule_type",
                                       hint=f"use one of: {', '.join(SCHEDULE_TYPES)}"))
        for name in ("min_value", "max_value", "require_steps", "seq_per_step"):
            if int(getattr(self, name)) < 1:
                raise TpirError(Diagnostic(f"random-LTD {name} must be at least 1, not {getattr(self, name)}",
                                           where=f"random_ltd_schedule.{name}", hint=f"e.g. {name} 1"))
        if self.min_value > self.max_value:
            raise TpirError(Diagnostic(
                f"random-LTD min_value {self.min_value} is above max_value {self.max_value}",
                where="random_ltd_schedule", hint="the kept count grows from min_value to max_value"))
        if not self.units:
            raise TpirError(Diagnostic("random-LTD names no unit to drop tokens in", where="--random-ltd",
                                       hint="name the middle units, e.g. 1:3"))

    def kept(self, step: int) -> int:
        """Kept tokens per sequence at `step` (0-based; the module docstring's schedule)."""
        frac = float(step) / self.require_steps
        k = math.floor(frac * (self.max_value - self.min_value) + self.min_value)
        k -= k % self.seq_per_step
        return max(1, min(k, self.max_value))

    def priced_fraction(self, seq: int) -> float:
        """The fraction of a sequence of `seq` tokens a dropped unit keeps on the average step
        of the schedule's ramp: the mean of min(kept(s), seq) / seq over steps 0..require_steps-1
        (at least one step). The cost model prices dropped units by it (costmodel/dropped.py):
        one partition and one slicing serve every step of the ramp."""
        import numpy as np

        s = np.arange(max(1, self.require_steps), dtype=np.float64)
        k = np.floor(s / self.require_steps * (self.max_value - self.min_value) + self.min_value)
        k -= np.mod(k, self.seq_per_step)
        k = np.clip(k, 1, min(self.max_value, seq))
        return float(k.mean() / seq)

    def fractions(self, seq: int) -> dict[int, float]:
        """{dropped unit: `priced_fraction(seq)`}: what the cost model prices."""
        f = self.priced_fraction(seq)
        return {u: f for u in self.units}

    def slice_counts(self, kept: int, lengths) -> list[int]:
        """How many tokens each slice of `lengths` keeps out of `kept` for the sequence."""
        total = sum(lengths)
        k = min(kept, total)
        out, end, before = [], 0, 0
        for n in lengths:
            end += n
            upto = k * end // total
            out.append(max(1, min(n, upto - before)))
            before = upto
        return out

    def keep(self, step: int, replica: int, mb: int, unit: int, slice_index: int, length: int,
             count: int) -> torch.Tensor:
        """The sorted positions (within its slice, int64, CPU) of the `count` tokens a slice of
        `length` tokens keeps in `unit`."""
        if count >= length:
            return torch.arange(length)
        seed = self.seed
        for x in (step, replica, mb, unit, slice_index):
            seed = (seed * _MIX + int(x)) % (2 ** 62)
        gen = torch.Generator().manual_seed(seed)
        return torch.randperm(length, generator=gen)[:count].sort().values

    def micro_batch(self, step: int, replica: int, mb: int, lengths) -> dict[int, list[torch.Tensor]]:
        """Per dropped unit, each slice's kept positions (within the slice) for one micro-batch
        cut into slices of `lengths`."""
        counts = self.slice_counts(self.kept(step), lengths)
        return {u: [self.keep(step, replica, mb, u, i, n, c) for i, (n, c) in enumerate(zip(lengths, counts))]
                for u in self.units}

    def positions(self, step: int, replica: int, mb: int, lengths) -> dict[int, torch.Tensor]:
        """Per dropped unit, the kept positions of the whole micro-batch (its slices' subsets
        shifted by their offsets, concatenated): what the unsliced oracle gathers."""
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        return {u: torch.cat([k + s for k, s in zip(per, starts)])
                for u, per in self.micro_batch(step, replica, mb, lengths).items()}


def from_pair(units: str | None, schedule: str | None, seed: int = 1234) -> RandomLTD | None:
    """`--random-ltd UNITS` with its `--random-ltd-schedule S` (of `tpc compile` or `tpc run`),
    or None when neither is given; one without the other is refused."""
    if units is None and schedule is None:
        return None
    if units is None or schedule is None:
        given, missing = ("--random-ltd", "--random-ltd-schedule") if schedule is None else \
            ("--random-ltd-schedule", "--random-ltd")
        raise TpirError(Diagnostic(f"{given} needs {missing}", where=given,
                                   hint="e.g. --random-ltd 1:7 --random-ltd-schedule 128,2048,20000,16"))
    return from_flags(units, schedule, seed=seed)


def from_line(line, seed: int = 1234) -> RandomLTD:
    """The `RandomLTD` a plan's `random-ltd` line records (tpc.ir.nodes.RandomLTDLine), drawing
    from `seed` (the run's)."""
    return RandomLTD(units=tuple(line.units), min_value=line.min_value, max_value=line.max_value,
                     require_steps=line.require_steps, seq_per_step=line.seq_per_step, seed=seed)


def to_line(ltd: RandomLTD):
    """The plan's `random-ltd` line of `ltd` (its seed is the run's, not the plan's)."""
    from tpc.ir.nodes import RandomLTDLine

    return RandomLTDLine(units=tuple(ltd.units), min_value=ltd.min_value, max_value=ltd.max_value,
                         require_steps=ltd.require_steps, seq_per_step=ltd.seq_per_step)


def same_dropping(a: RandomLTD, b: RandomLTD) -> bool:
    """Whether `a` and `b` drop in the same units on the same schedule (seeds aside)."""
    return to_line(a) == to_line(b)


def describe(ltd: RandomLTD) -> str:
    """`--random-ltd U --random-ltd-schedule MIN,MAX,STEPS,Q`, as the flags spell `ltd`."""
    return (f"--random-ltd {','.join(map(str, ltd.units))} --random-ltd-schedule "
            f"{ltd.min_value},{ltd.max_value},{ltd.require_steps},{ltd.seq_per_step}")


def from_flags(units: str, schedule: str, seed: int = 1234) -> RandomLTD:
    """`--random-ltd UNITS --random-ltd-schedule S`: S is MIN,MAX,REQUIRE_STEPS[,SEQ_PER_STEP],
    or DeepSpeed's `random_ltd_schedule` as JSON text or a .json file holding it (its
    `min_value`, `max_value`, `schedule_type`, `schedule_config.require_steps` and
    `.seq_per_step`), alone or inside a DeepSpeed config."""
    import json
    from pathlib import Path

    text = schedule.strip()
    try:
        if text.startswith("{") or text.endswith(".json"):
            conf = json.loads(text if text.startswith("{") else Path(text).read_text())
            conf = _schedule_section(conf)
            sub = conf.get("schedule_config", {})
            return RandomLTD(units=parse_units(units), min_value=int(conf["min_value"]),
                             max_value=int(conf["max_value"]), require_steps=int(sub["require_steps"]),
                             seq_per_step=int(sub.get("seq_per_step", 1)),
                             schedule_type=conf.get("schedule_type", "fixed_linear"), seed=seed)
        numbers = [int(x) for x in text.split(",")]
        if len(numbers) not in (3, 4):
            raise ValueError(text)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise TpirError(Diagnostic(f"cannot read the random-LTD schedule {schedule!r} ({type(e).__name__}: {e})",
                                   where="--random-ltd-schedule",
                                   hint="MIN,MAX,REQUIRE_STEPS[,SEQ_PER_STEP], e.g. 128,2048,20000,16, or "
                                        "DeepSpeed's random_ltd_schedule JSON")) from None
    return RandomLTD(parse_units(units), *numbers[:3], *(numbers[3:] or [1]), seed=seed)


def _schedule_section(conf: dict) -> dict:
    """The `random_ltd_schedule` dict inside a DeepSpeed config (at any depth: a whole
    ds_config.json holds it under data_efficiency.data_routing.random_ltd), or `conf` itself."""
    stack = [conf]
    while stack:
        d = stack.pop()
        if "random_ltd_schedule" in d:
            return d["random_ltd_schedule"]
        stack.extend(v for v in d.values() if isinstance(v, dict))
    return conf


def parse_units(text: str, num_units: int | None = None) -> tuple[int, ...]:
    """`--random-ltd` units: "A:B" (units A..B-1), or a comma list; refused outside the middle
    units 1..num_units-2 (with `num_units`; else the stages refuse them when built)."""
    try:
        if ":" in text:
            a, b = text.split(":")
            units = tuple(range(int(a), int(b)))
        else:
            units = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise TpirError(Diagnostic(f"cannot read the units {text!r}", where="--random-ltd",
                                   hint="write A:B (units A to B-1) or a comma list, e.g. 1:3")) from None
    bad = [u for u in units if u < 1 or (num_units is not None and u > num_units - 2)]
    if not units or bad:
        middle = f"1..{num_units - 2}" if num_units is not None else "from 1 on"
        raise TpirError(Diagnostic(
            f"random-LTD drops tokens in the middle units ({middle}) only, not {bad or text!r}",
            where="--random-ltd", hint="e.g. --random-ltd 1:3 (units 1 and 2)"))
    return units
