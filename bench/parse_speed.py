"""Time of `parse` on generated plans of a few sizes, in microseconds per line.

The plans come from the compiler itself (a header, a schedule builder and `lower`), printed
canonically, once without comments and once with a comment above and at the end of every tenth
instruction. Times are CPU seconds of this process (on a shared machine, wall time also counts
the time other processes had the core); each plan is parsed `--repeat` times and the best time is
kept. Target: <= 50 us per line.

`--compare REV` also loads the parser and grammar of git revision REV (e.g. a commit before a
change to the parser) and times both on the same texts in the same run, side by side; it checks
that both give equal plans with equal locations and comments. `--compare ae6f816` is the parser
that built a parse tree first and transformed it afterwards.

    OMP_NUM_THREADS=1 python bench/parse_speed.py [--quick] [--compare REV]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule
from tpc.ir.nodes import (
    Header,
    MeshLine,
    Microbatch,
    ModelLine,
    Plan,
    RankProgram,
    ScheduleLine,
    ShapeLine,
    Stage,
    Tie,
    UnitsLine,
)
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan

ROOT = Path(__file__).resolve().parents[1]
TARGET_US_PER_LINE = 50.0

# (schedule, pipeline ranks, micro-batches, slices per micro-batch, data ranks)
SIZES = [
    ("terapipe", 2, 2, 8, 1),
    ("1f1b", 4, 8, 16, 2),
    ("terapipe", 8, 16, 32, 1),
    ("seq1f1b", 8, 32, 48, 2),
]
QUICK = SIZES[:3]


def make_plan(schedule: str, pipe: int, mbs: int, slices: int, data: int) -> Plan:
    seq = 8 * slices
    cuts = tuple((8 * i, 8 * i + 8) for i in range(slices))
    header = Header(
        model=ModelLine("examples/gpt.py", "0" * 64, "model"),
        shape=ShapeLine(batch=mbs * data, seq=seq, vocab=256),
        mesh=MeshLine(pipe=pipe, data=data),
        schedule=ScheduleLine(schedule),
        units=UnitsLine(pipe),
        stages=tuple(Stage(s, s, (s, s + 1), f"unit {s}") for s in range(pipe)),
        ties=(Tie("transformer.wte.weight", (0, pipe - 1)),) if pipe > 1 else (),
        microbatches=tuple(Microbatch(m, 1, cuts) for m in range(mbs)),
    )
    return lower(header, build_schedule(schedule, header), verify=False)


def with_comments(plan: Plan) -> Plan:
    """A comment above and one at the end of every tenth instruction, and one above each rank."""
    ranks = []
    for r in plan.ranks:
        instrs = tuple(
            i.with_trivia(comments=(f"step {n} of rank {r.rank}",), note="look here")
            if n % 10 == 0 else i
            for n, i in enumerate(r.instrs)
        )
        ranks.append(RankProgram(r.rank, instrs, comments=(f"rank {r.rank}",), note="a rank"))
    return Plan(header=plan.header, ranks=tuple(ranks), trailing_comments=("the end",))


def parser_at(rev: str):
    """`parse` of the parser and grammar at git revision `rev`, loaded beside the current one."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout

    source, grammar = show("ir/parse.py"), show("grammar/tpir.lark")
    wanted = "from tpc.grammar import grammar_text\n"
    if wanted not in source:
        sys.exit(f"{rev}:ir/parse.py does not read its grammar through tpc.grammar; cannot load it")
    module = types.ModuleType(f"parse_at_{rev}")
    module.grammar_text = lambda: grammar
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(source.replace(wanted, ""), f"{rev}:ir/parse.py", "exec"), module.__dict__)
    return module.parse


def best_time(fn, text: str, repeat: int) -> tuple[float, Plan]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.process_time()
        result = fn(text, "bench.tpir")
        best = min(best, time.process_time() - t0)
    return best, result


def trivia(plan: Plan) -> list:
    """Locations and comments of every line (plan equality ignores them)."""
    h = plan.header
    out: list = [(h.version_loc, h.version_comments, h.version_note)]
    for line in [h.model, h.shape, h.mesh, h.schedule, h.units, *h.stages, *h.ties,
                 *h.microbatches]:
        out.append((line.loc, line.comments, line.note))
    for r in plan.ranks:
        out.append((r.loc, r.comments, r.note))
        out += [(i.loc, i.comments, i.note) for i in r.instrs]
    out.append(plan.trailing_comments)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the three smaller plans")
    ap.add_argument("--repeat", type=int, default=3, help="parses per plan; the best counts")
    ap.add_argument("--compare", metavar="REV", help="also time the parser of git revision REV")
    args = ap.parse_args(argv)

    before = parser_at(args.compare) if args.compare else None
    for fn in filter(None, (parse, before)):  # build the parsers outside the timings
        try:
            fn("", "warm.tpir")
        except Exception:  # noqa: BLE001 - an empty text is an error; only the build matters
            pass

    head = f"{'plan':<30} {'comments':>8} {'lines':>7} {'seconds':>8} {'us/line':>8}"
    if before:
        head += f" {args.compare + ' s':>12} {'us/line':>8} {'speed-up':>8}"
    print(head)
    ok = True
    for schedule, pipe, mbs, slices, data in (QUICK if args.quick else SIZES):
        plan = make_plan(schedule, pipe, mbs, slices, data)
        for commented in (False, True):
            p = with_comments(plan) if commented else plan
            text = print_plan(p)
            lines = text.count("\n")
            secs, got = best_time(parse, text, args.repeat)
            if got != p or print_plan(got) != text:
                sys.exit(f"parse(print(plan)) differs from the plan ({schedule} {pipe}x{mbs}x{slices})")
            us = secs / lines * 1e6
            ok &= us <= TARGET_US_PER_LINE
            name = f"{schedule} pipe {pipe} mbs {mbs} slices {slices}"
            row = f"{name:<30} {'yes' if commented else 'no':>8} {lines:>7} {secs:>8.3f} {us:>8.1f}"
            if before:
                old_secs, old = best_time(before, text, args.repeat)
                if old != got or trivia(old) != trivia(got):
                    sys.exit(f"the two parsers disagree on {name}")
                row += f" {old_secs:>12.3f} {old_secs / lines * 1e6:>8.1f} {old_secs / secs:>7.1f}x"
            print(row, flush=True)
    print(f"target: <= {TARGET_US_PER_LINE:g} us per line: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
