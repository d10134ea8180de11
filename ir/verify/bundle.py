"""Plan bundles (format version 2): rules B1-B4 (see tpc.ir.verify), and reading a bundle.

A bundle is one plan per sequence length, written by `tpc compile --seq-len 64,128,...` into a
folder with an index (`index.tpir`: `tpir 2`, `bundle`, the shared model, mesh, units, stage and
tie lines, then one `plan "PATH" seq L batch B` line per plan). A run that switches plans between
steps (a sequence-length curriculum) keeps every weight where it is only if every plan cuts the
model the same way, so the index records the split once and every plan must repeat it exactly.

`load_bundle(path)` reads the index (or the folder holding `index.tpir`) and every plan it lists,
verifies each plan by every plan rule and the bundle by B1-B4, and raises one `TpirError` with
every diagnostic, each located in its own file. Nothing here communicates: the executors call it
before they join a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Bundle, Plan
from tpc.ir.semantics import DEFAULT_COMM, CommRules
from tpc.ir.verify.header import check_tensor_axis, require_version
from tpc.ir.verify.report import Report

INDEX = "index.tpir"  # the index's name inside a bundle folder


@dataclass(frozen=True)
class LoadedBundle:
    """A verified bundle: its index and its plans, in the index's order (increasing length)."""

    index: Bundle
    plans: tuple[Plan, ...]

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.index.lengths

    def plan(self, seq: int) -> Plan:
        return self.plans[self.lengths.index(seq)]

    @property
    def longest(self) -> Plan:
        return self.plans[-1]


def index_path(path: str) -> Path:
    """The index file of `path`: the path itself, or `index.tpir` in a folder."""
    p = Path(path)
    return p / INDEX if p.is_dir() else p


def is_bundle(path: str) -> bool:
    """Whether `path` is a bundle folder or a bundle's index (by its first lines), without
    parsing the whole file."""
    p = Path(path)
    if p.is_dir():
        return True
    if not p.is_file():
        return False
    try:
        with p.open(encoding="utf-8", errors="replace") as f:
            words = []
            for line in f:
                text = line.split("#", 1)[0].strip()
                if text:
                    words.append(text)
                if len(words) == 2:
                    break
    except OSError:
        return False
    return len(words) == 2 and words[0].startswith("tpir") and words[1] == "bundle"


def load_bundle(path: str, comm: CommRules = DEFAULT_COMM) -> LoadedBundle:
    """Read and verify the bundle at `path` (its folder or its index), every plan under the
    communication rules `comm`; every error at once."""
    from tpc.ir.files import read_text
    from tpc.ir.parse import parse_bundle
    from tpc.ir.verify import verify_file

    index = index_path(path)
    if not index.is_file():
        raise TpirError(Diagnostic(
            f"no plan bundle at {path}" + (f" (no {INDEX} in the folder)" if Path(path).is_dir() else ""),
            hint="give the folder `tpc compile --seq-len L1,L2,... -o FOLDER` wrote, or its index.tpir"))
    text = read_text(index, what="a plan bundle's index")
    bundle = parse_bundle(text, file=str(index))
    rep = Report(bundle)
    plans: dict[int, Plan] = {}
    errors: list[Diagnostic] = []
    if require_version(bundle, rep, 2, bundle.bundle.loc, "index (bundle)", (0, 0),
                       "a plan bundle's index"):
        check_tensor_axis(bundle, rep)
        if _check_members(bundle, rep):
            for k, member in enumerate(bundle.members):
                file = index.parent / member.path
                try:
                    plans[k] = verify_file(str(file), comm)
                except TpirError as e:
                    if not file.is_file():
                        rep.add(member.loc, f"index, plan line {k}", (1, k),
                                f"the plan file {member.path!r} does not exist (looked for {file})",
                                "plan paths are relative to the index's folder; recompile the bundle "
                                "or fix the path")
                    else:
                        errors += e.diagnostics
            for k, plan in plans.items():
                _check_plan(bundle, bundle.members[k], plan, rep)
            _check_shapes(bundle, plans, rep)
    diagnostics = rep.sorted() + errors
    if diagnostics:
        raise TpirError(diagnostics, source=None)
    return LoadedBundle(bundle, tuple(plans[k] for k in range(len(bundle.members))))


def _check_members(bundle: Bundle, rep: Report) -> bool:
    """B2: at least one plan; lengths distinct and increasing."""
    if not bundle.members:
        rep.add(bundle.units.loc, "index", (1, 0), "the bundle lists no plans",
                'add one `plan "PATH" seq L batch B` line per plan, after the stage and tie lines')
        return False
    ok = True
    for k, (prev, cur) in enumerate(zip(bundle.members, bundle.members[1:]), start=1):
        if cur.seq <= prev.seq:
            ok = False
            rep.add(cur.loc, f"index, plan line {k}", (1, k),
                    f"a plan of length {cur.seq} listed after one of length {prev.seq} "
                    f"(line {prev.loc.line if prev.loc else k})",
                    "list one plan per length, by increasing length")
    return ok


def _check_plan(bundle: Bundle, member, plan: Plan, rep: Report) -> None:
    """B3 (the index's model, mesh, units, stage split and ties) and B4 (the plan line's length
    and batch; one vocabulary and dtype), located in the plan's file."""
    h = plan.header
    listed = f"listed at {member.loc}" if member.loc else f"the plan of length {member.seq}"
    where = f"plan {member.path}"

    def refuse(line, index_line, what: str, hint: str) -> None:
        at = f" (the index's line {index_line.loc.line})" if index_line is not None and index_line.loc else ""
        rep.add(line.loc if line is not None else member.loc, where, (2, member.seq),
                f"{what}{at}; this plan is {listed}", hint)

    recompile = ("every plan of a bundle must cut the same model the same way: recompile them "
                 "together with `tpc compile MODEL -o FOLDER --seq-len L1,L2,...`")
    if h.model != bundle.model:
        refuse(h.model, bundle.model,
               f"this plan's model ({h.model.path}, sha256 {h.model.sha256[:12]}..., factory "
               f"{h.model.factory}) is not the bundle's ({bundle.model.path}, sha256 "
               f"{bundle.model.sha256[:12]}..., factory {bundle.model.factory})", recompile)
    if h.mesh != bundle.mesh:
        refuse(h.mesh, bundle.mesh, f"this plan's mesh ({h.mesh.sizes}) is "
               f"not the bundle's ({bundle.mesh.sizes})", recompile)
    if h.units != bundle.units:
        refuse(h.units, bundle.units, f"this plan has {h.units.count} units, the bundle "
               f"{bundle.units.count}", recompile)
    split = [(s.index, s.rank, s.units) for s in h.stages]
    shared = [(s.index, s.rank, s.units) for s in bundle.stages]
    if split != shared:
        k = next((i for i, (a, b) in enumerate(zip(split, shared)) if a != b), min(len(split), len(shared)))
        line = h.stages[k] if k < len(h.stages) else h.stages[-1]
        index_line = bundle.stages[k] if k < len(bundle.stages) else bundle.stages[-1]
        refuse(line, index_line, "this plan's stage split (" + _split_text(split) + ") is not the "
               "bundle's (" + _split_text(shared) + ")",
               recompile + " (weights stay on their ranks only when every plan splits alike)")
    if [(t.name, t.stages) for t in h.ties] != [(t.name, t.stages) for t in bundle.ties]:
        refuse(h.ties[0] if h.ties else h.stages[0], bundle.ties[0] if bundle.ties else None,
               "this plan's tie lines are not the bundle's", recompile)
    if h.shape.seq != member.seq or h.shape.batch != member.batch:
        refuse(h.shape, None, f"this plan is of length {h.shape.seq} and batch {h.shape.batch}, its "
               f"plan line says seq {member.seq} batch {member.batch}",
               "fix the plan line in the index, or list the right plan file")


def _check_shapes(bundle: Bundle, plans: dict[int, Plan], rep: Report) -> None:
    """B4: one vocabulary and one dtype across the plans (those of the first plan read)."""
    if not plans:
        return
    k0 = min(plans)
    base = plans[k0].header.shape
    for k, plan in sorted(plans.items()):
        shape = plan.header.shape
        if (shape.vocab, shape.dtype) != (base.vocab, base.dtype):
            rep.add(shape.loc, f"plan {bundle.members[k].path}", (2, bundle.members[k].seq),
                    f"this plan has vocab {shape.vocab} dtype {shape.dtype}, the plan of length "
                    f"{bundle.members[k0].seq} vocab {base.vocab} dtype {base.dtype}",
                    "every plan of a bundle is of one model: recompile them together")


def _split_text(split) -> str:
    return ", ".join(f"stage {i} rank {r} units {lo}:{hi}" for i, r, (lo, hi) in split)
