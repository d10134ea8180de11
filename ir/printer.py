"""Plan to text: `print_plan(plan) -> str`, the one canonical spelling of a plan.

The canonical form is the one docs/ir.md ("Comments and canonical form") describes, and the one
`tpc fmt` writes: `print_plan(parse(t)) == t` for canonical `t`, and `parse(print_plan(p)) == p`
for any valid plan `p`. Instructions are spelled by `Instr.__str__` and strings by `nodes.quote`,
so there is one spelling of each thing in the code base.
"""

from __future__ import annotations

from tpc.ir.nodes import (
    Bundle,
    BundleLine,
    BundleMember,
    DocumentsLine,
    Instr,
    Line,
    MeshLine,
    RandomLTDLine,
    Microbatch,
    ModelLine,
    Plan,
    RankProgram,
    ScheduleLine,
    ShapeLine,
    Stage,
    Tie,
    UnitsLine,
    quote,
)

INDENT = "  "  # instructions, and the comments that belong to them; the members of an
# `exchange N` are indented twice


def print_plan(plan: Plan) -> str:
    """The canonical text of `plan`, ending with one newline."""
    h = plan.header
    out: list[str] = []
    _emit(out, "", h.version_comments, f"tpir {h.version}", h.version_note)
    header_lines: list[Line] = [h.model, h.shape, *([h.documents] if h.documents else []), h.mesh, h.schedule, h.units,
                                *([h.random_ltd] if h.random_ltd else []), *h.stages,
                                *h.ties, *h.microbatches]
    for line in header_lines:
        _emit(out, "", line.comments, line_text(line), line.note)
    _emit_ranks(out, plan.ranks)
    if plan.eval is not None:
        ev = plan.eval
        out.append("")
        _emit(out, "", ev.comments, "eval", ev.note)
        for line in ev.microbatches:
            _emit(out, "", line.comments, line_text(line), line.note)
        _emit_ranks(out, ev.ranks)
    out += [INDENT + comment_text(c) for c in plan.trailing_comments]
    return "\n".join(out) + "\n"


def _emit_ranks(out: list[str], ranks) -> None:
    for program in ranks:
        out.append("")
        _emit(out, "", program.comments, line_text(program), program.note)
        members = 0  # lines of an exchange still to come: indented one level more
        for instr in program.instrs:
            _emit(out, INDENT * (2 if members else 1), instr.comments, str(instr), instr.note)
            members = instr.count if instr.count is not None else max(0, members - 1)
def print_bundle(bundle: Bundle) -> str:
    """The canonical text of a plan bundle's index, ending with one newline."""
    b = bundle
    out: list[str] = []
    _emit(out, "", b.version_comments, f"tpir {b.version}", b.version_note)
    for line in [b.bundle, b.model, b.mesh, b.units, *b.stages, *b.ties, *b.members]:
        _emit(out, "", line.comments, line_text(line), line.note)
    out += [comment_text(c) for c in b.trailing_comments]
    return "\n".join(out) + "\n"


def print_document(doc) -> str:
    """A plan or a bundle's index, each in its canonical form."""
    return print_bundle(doc) if isinstance(doc, Bundle) else print_plan(doc)


def line_text(line: Line) -> str:
    """One line-level item as it is written, without comments or indentation."""
    if isinstance(line, Instr):
        return str(line)
    if isinstance(line, RankProgram):
        return f"rank {line.rank}"
    if isinstance(line, ModelLine):
        return (f"model {quote(line.path)} sha256 {quote(line.sha256)} "
                f"factory {quote(line.factory)}")
    if isinstance(line, ShapeLine):
        return f"shape batch {line.batch} seq {line.seq} vocab {line.vocab} dtype {line.dtype}"
    if isinstance(line, DocumentsLine):
        return f"documents eos {line.eos} mean {line.mean}"
    if isinstance(line, RandomLTDLine):
        return (f"random-ltd units {' '.join(str(u) for u in line.units)} min-value {line.min_value} "
                f"max-value {line.max_value} require-steps {line.require_steps} seq-per-step {line.seq_per_step}")
    if isinstance(line, MeshLine):
        return f"mesh {line.sizes}"
    if isinstance(line, ScheduleLine):
        return f"schedule {quote(line.name)}"
    if isinstance(line, UnitsLine):
        return f"units {line.count}"
    if isinstance(line, Stage):
        lo, hi = line.units
        where = (f"rank {line.rank}" if not line.replicas
                 else "ranks " + " ".join(str(r) for r in line.ranks))
        text = f"stage {line.index} {where} units {lo}:{hi}"
        # an empty label is left out rather than written as ""
        return f"{text} {quote(line.label)}" if line.label else text
    if isinstance(line, Tie):
        return f"tie {quote(line.name)} stages " + " ".join(str(s) for s in line.stages)
    if isinstance(line, Microbatch):
        slices = " ".join(f"{lo}:{hi}" for lo, hi in line.slices)
        replica = f" replica {line.replica}" if line.replica else ""
        return f"microbatch {line.index} size {line.size} slices {slices}{replica}"
    if isinstance(line, BundleLine):
        return "bundle"
    if isinstance(line, BundleMember):
        return f"plan {quote(line.path)} seq {line.seq} batch {line.batch}"
    raise TypeError(f"not a line of a plan: {type(line).__name__}")


def comment_text(text: str) -> str:
    """A comment as written: '# text', or a bare '#' for an empty one (no trailing blank)."""
    return f"# {text}" if text else "#"


def _emit(out: list[str], indent: str, comments, text: str, note: str | None) -> None:
    out += [indent + comment_text(c) for c in comments]
    out.append(indent + text + (f"  {comment_text(note)}" if note is not None else ""))
