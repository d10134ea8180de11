"""From a torch schedule CSV to a verified plan, every error said at the cell it comes from.

    actions ──to instructions──► per-rank streams ──lowering passes──► plan ──verify──► cells

Each action becomes tpc instructions (`F` forward, `B` backward, `I` backward-input, `W`
backward-weight, an OVERLAP_F_B cell its computations in order, as torch's runtime runs them).
Micro-batch index k is the k-th (micro-batch, token slice) of the header (`slice_map`).

The two forms torch writes are read as follows.

* compute only (`_dump_csv` of `pipeline_order`): tpc's own lowering (compiler/lowering/lower.py) adds
  the sends and receives, loads, free-kv, gradient reductions and the step. A compute order that
  cannot run (a dependency broken, a cycle of ranks waiting for each other) is reported by the
  verifier at the cell of the computation concerned.
* compute + comms (`_dump_csv(format="compute_comms")`): the CSV's own SEND_F / RECV_F / SEND_B
  / RECV_B are the plan's sends and receives, where the CSV puts them. A receive is taken to
  wait where it is written, as torch's `_simulate_comms_compute` takes it. So the verifier
  checks the CSV's communication itself: each message sent once and received once by the rank
  of the neighbouring stage, a send after the computation producing it, a receive before the one
  consuming it, the receives of each channel in the order of its sends (torch posts them
  untagged: a crossed pair swaps two micro-batches' tensors), and no rank waiting forever.

The other actions: `REDUCE_GRAD` is `allreduce stage S` where the plan has data-parallel
replicas (where the CSV puts it; tpc places it for stages without one), and nothing with one
replica; `UNSHARD` / `RESHARD` (FSDP) are checked as torch's runtime checks them (no unshard
twice, no reshard of a sharded stage, no computation on a stage the CSV has resharded) and then
dropped: a tpc rank keeps its stages' parameters whole.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from tpc.compiler.lowering import lower as lowering
from tpc.compiler.torch_schedule import actions as A
from tpc.compiler.torch_schedule.actions import Action, TorchCsv
from tpc.compiler.torch_schedule.cells import Cells, Origin
from tpc.compiler.torch_schedule.layout import layout_of
from tpc.compiler.torch_schedule.slice_map import flat_units
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import COMPUTE_OPS, Header, Instr, Op, Payload, Plan, RankProgram
from tpc.ir.semantics import GLOO, NCCL

_COMPUTE_OP = {A.FORWARD: Op.FORWARD, A.FULL_BACKWARD: Op.BACKWARD,
               A.BACKWARD_INPUT: Op.BACKWARD_INPUT, A.BACKWARD_WEIGHT: Op.BACKWARD_WEIGHT}


@dataclass(frozen=True)
class Imported:
    """The verified plan (locations: the CSV cells) and what the import left out, by kind."""

    plan: Plan
    dropped: dict[str, int] = field(default_factory=dict)
    comms_from_csv: bool = False

    def summary(self) -> str:
        """One line for people: where the communication came from and what was dropped."""
        comm = "the CSV's own sends and receives" if self.comms_from_csv else "sends and receives placed by tpc"
        text = f"{comm}"
        if self.dropped:
            text += "; dropped " + ", ".join(f"{n} {k}" for k, n in sorted(self.dropped.items()))
        return text


def plan_from_schedule(sched: TorchCsv, header: Header, units=None) -> Imported:
    """The verified plan running `sched` under `header`, whose mesh and stage placement must be
    the CSV's (`layout.place`). `units[k]` is the (micro-batch, slice) of torch index k
    (default: the header's, flattened in forward order). TpirError at the cells otherwise."""
    layout = layout_of(sched)
    placed = tuple(st.rank for st in header.stages)
    if header.mesh.pipe != layout.ranks or placed != layout.stage_rank:
        raise TpirError(Diagnostic(
            f"the header places stages on ranks {list(placed)} of {header.mesh.pipe}, the schedule on "
            f"{list(layout.stage_rank)} of {layout.ranks}", where=sched.path,
            hint="build the header with the CSV's placement (tpc.compiler.torch_schedule.place)"))
    units = tuple(units) if units is not None else flat_units(header)
    cells = Cells(sched.path, units)
    streams, origins, dropped, problems = _instructions(sched, header, units)
    from tpc.ir.verify import verify

    stalls = _not_progressing(sched, header, streams, origins, cells) if sched.has_comms else []
    streams = _lower(header, streams, comms=sched.has_comms)
    plan = _numbered(sched, header, streams, origins, cells)
    # the actions that could not become instructions are left out and the rest verified, so
    # one run reports everything (a stage's wrong micro-batch and the one it then lacks)
    found = [cells.relocate(d) for d in verify(plan, NCCL)]
    if stalls:  # the same wait said once, in torch's terms, not again as NCCL's deadlock
        found = [d for d in found if not d.message.startswith("deadlock")]
    diagnostics = problems + stalls + found
    if diagnostics:
        located = sorted(diagnostics, key=lambda d: (d.loc.line, d.loc.col) if d.loc else (0, 0))
        raise TpirError(located, source=sched.text)
    return Imported(cells.at_cells(plan), dict(dropped), sched.has_comms)


# ------------------------------------------------------------------------ actions -> instructions


def _instructions(sched: TorchCsv, header: Header, units):
    """Per rank, the instructions the CSV's actions say, and each one's origin (by identity)."""
    problems: list[Diagnostic] = []
    streams: dict[int, list[Instr]] = {}
    origins: dict[int, tuple[Instr, Origin]] = {}
    dropped: Counter = Counter()
    k = header.num_stages
    rank_of = [st.rank for st in header.stages]
    for rank, row in enumerate(sched.rows):
        out: list[Instr] = []
        fsdp = _Fsdp({a.stage for a in row if a.kind in (A.UNSHARD, A.RESHARD)})
        for a in row:
            problem = fsdp.check(a)
            if problem:
                problems.append(problem)
            if a.kind in (A.UNSHARD, A.RESHARD):
                dropped[f"{a.kind} (FSDP)"] += 1
                continue
            if a.kind == A.REDUCE_GRAD:
                if header.mesh.data > 1:
                    out.append(_keep(Instr(Op.ALLREDUCE, stage=a.stage), a, origins))
                else:
                    dropped["REDUCE_GRAD (one data-parallel replica)"] += 1
                continue
            if a.mb >= len(units):
                problems.append(Diagnostic(
                    f"`{a}` names micro-batch {a.mb}, but the schedule runs micro-batches 0..{len(units) - 1}",
                    loc=a.loc, hint=f"every stage runs the same {len(units)} micro-batches (as most stages' "
                                    "forwards say): a stage runs each of them once"))
                continue
            m, i = units[a.mb]
            if a.kind in _COMPUTE_OP:
                out.append(_keep(Instr(_COMPUTE_OP[a.kind], stage=a.stage, mb=m, slice=i), a, origins))
                continue
            neighbour = a.stage + 1 if a.kind in (A.SEND_F, A.RECV_B) else a.stage - 1
            if not 0 <= neighbour < k:
                problems.append(Diagnostic(_no_neighbour(a, k), loc=a.loc, hint="remove this action"))
                continue
            op = Op.SEND if a.kind in (A.SEND_F, A.SEND_B) else Op.RECV
            payload = Payload.ACT if a.kind in (A.SEND_F, A.RECV_F) else Payload.GRAD
            out.append(_keep(Instr(op, payload=payload, stage=a.stage, mb=m, slice=i,
                                   peer=rank_of[neighbour]), a, origins))
        streams[rank] = out
    return streams, origins, dropped, problems


def _keep(ins: Instr, action: Action, origins: dict) -> Instr:
    origins[id(ins)] = (ins, Origin(action, action.rank))  # the instruction kept alive: ids stay unique
    return ins


def _no_neighbour(a: Action, k: int) -> str:
    return {
        A.SEND_F: f"`{a}`: stage {a.stage} is the last stage; it sends no activation (its output is the loss)",
        A.RECV_F: f"`{a}`: stage {a.stage} is the first stage; it receives no activation (it reads token ids)",
        A.SEND_B: f"`{a}`: stage {a.stage} is the first stage; it sends no input gradient",
        A.RECV_B: f"`{a}`: stage {a.stage} is the last stage; it receives no gradient (it starts from its loss)",
    }[a.kind] + f" (the schedule has stages 0..{k - 1})"


class _Fsdp:
    """UNSHARD / RESHARD on one rank, as torch's runtime asserts them for an FSDP stage: a stage
    the CSV shards or unshards starts sharded; it is unsharded once before it is resharded; it
    computes only while unsharded."""

    def __init__(self, stages: set[int]):
        self.managed = stages
        self.unsharded: set[int] = set()

    def check(self, a: Action) -> Diagnostic | None:
        s = a.stage
        if a.kind == A.UNSHARD:
            if s in self.unsharded:
                return Diagnostic(f"`{a}` unshards stage {s} twice without a RESHARD between", loc=a.loc,
                                  hint="torch's runtime asserts 'Unsharding the same stage_idx twice': remove it")
            self.unsharded.add(s)
        elif a.kind == A.RESHARD:
            if s not in self.unsharded:
                return Diagnostic(f"`{a}` reshards stage {s}, which is not unsharded here", loc=a.loc,
                                  hint=f"torch's runtime asserts 'Resharding stage_idx without unsharding': "
                                       f"put `{s}UNSHARD` before it, or remove it")
            self.unsharded.discard(s)
        elif a.kind in A.COMPUTE and s in self.managed and s not in self.unsharded:
            return Diagnostic(f"`{a}` computes on stage {s} while its parameters are sharded", loc=a.loc,
                              hint=f"torch's runtime asserts 'Attempted to compute on sharded' for an FSDP "
                                   f"stage: put `{s}UNSHARD` before it")
        return None


# ------------------------------------------------------------------- torch's comm semantics


def _not_progressing(sched: TorchCsv, header: Header, streams, origins: dict, cells: Cells) -> list[Diagnostic]:
    """The CSV's own communication run as torch runs it: a send never waits, a receive waits
    where it is written until its send has run (`_simulate_comms_compute`; its runtime waits at
    the consumer, no earlier than its simulator allows). Where a rank waits for a send its
    peer reaches only after that rank's wait, torch raises "Schedule is not progressing";
    tpc says so at the receive's cell. (Lowering for NCCL could make such a receive one
    exchange with the send after it, which would change the CSV's order: it is not done.)"""
    from tpc.ir.verify import verify

    as_written = _lower(header, streams, comms=True, exchanges=False)
    plan = _numbered(sched, header, as_written, origins, cells)
    out = []
    for d in verify(plan, GLOO):
        if not d.message.startswith("deadlock"):
            continue  # said by the verification of the plan as lowered
        d = cells.relocate(d)
        out.append(dataclasses.replace(
            d, message=d.message.replace("deadlock:", "not progressing (torch's `_simulate_comms_compute` "
                                                      "raises \"Schedule is not progressing\"):", 1),
            hint=d.hint + ". A receive in the CSV waits where it is written, as torch's simulator "
                          "runs it; a send never waits"))
    return out


# ---------------------------------------------------------------------------------- lowering


def _lower(header: Header, streams: dict[int, list[Instr]], *, comms: bool, exchanges: bool = True):
    """The lowering passes of compiler/lowering/lower.py, for NCCL's rules; the CSV's own communication
    replaces `insert_comm` when it has some, and its REDUCE_GRAD the `allreduce` tpc would
    place."""
    out = {r: tuple(s) for r, s in streams.items()}
    out = lowering.insert_loads(header, out)
    if not comms:
        out = lowering.insert_comm(header, out)
    out = lowering.insert_free_kv(header, out)
    placed = {ins.stage for s in streams.values() for ins in s if ins.op is Op.ALLREDUCE}
    with_tpc = lowering.insert_allreduce(header, out)
    if placed:  # keep the CSV's reductions; tpc's only for the stages the CSV did not reduce
        ours = {id(ins) for s in out.values() for ins in s}
        with_tpc = {r: tuple(ins for ins in s if id(ins) in ours or ins.stage not in placed)
                    for r, s in with_tpc.items()}
    # plans for NCCL: tpc.ir.semantics
    out = lowering.insert_exchanges(header, with_tpc) if exchanges else with_tpc
    out = lowering.insert_reduce_tied(header, out)
    return lowering.append_step(header, out)


# ------------------------------------------------------------------------------- locations


def _numbered(sched: TorchCsv, header: Header, streams, origins: dict, cells: Cells) -> Plan:
    """The plan, every instruction at a location of its own (see cells.py); instructions the
    lowering added are attributed to the action they serve."""
    ranks = []
    for r in range(header.mesh.pipe):
        stream = streams.get(r, ())
        attributed = _attribute(stream, origins, sched.rows[r], r)
        instrs = tuple(ins.with_trivia(loc=cells.loc(o, ins)) for ins, o in zip(stream, attributed))
        section = Origin(None, r)
        ranks.append(RankProgram(rank=r, instrs=instrs, loc=cells.loc(section, None)))
    return Plan(header=header, ranks=tuple(ranks), source=sched.path)


def _attribute(stream, origins: dict, row, rank: int) -> list[Origin]:
    """The origin of each instruction of one rank's stream. Those the lowering added belong to
    the action they serve: a load or receive to the computation after it, a send to the
    computation producing it, free-kv and allreduce to the last computation of their stage (and
    micro-batch), reduce-tied and step to the row's last action."""
    out: list[Origin | None] = [origins[id(ins)][1] if id(ins) in origins else None for ins in stream]
    last_action = row[-1] if row else None
    producer: dict[tuple, Origin] = {}
    latest: dict[tuple, Origin] = {}
    previous = None
    for p, ins in enumerate(stream):
        o = out[p]
        if o is not None:
            if ins.op in COMPUTE_OPS:
                previous = o
                latest[(ins.stage, ins.mb)] = o
                latest[(ins.stage,)] = o
                if ins.op is Op.FORWARD:
                    producer[(Payload.ACT, ins.stage, ins.mb, ins.slice)] = o
                elif ins.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                    producer[(Payload.GRAD, ins.stage, ins.mb, ins.slice)] = o
            continue
        if ins.op is Op.SEND:
            base = producer.get((ins.payload, ins.stage, ins.mb, ins.slice), previous)
        elif ins.op is Op.FREE_KV:
            base = latest.get((ins.stage, ins.mb), previous)
        elif ins.op is Op.ALLREDUCE:
            base = latest.get((ins.stage,), previous)
        elif ins.op is Op.EXCHANGE:  # the computation its first send serves
            first = stream[p + 1] if p + 1 < len(stream) else ins
            base = producer.get((first.payload, first.stage, first.mb, first.slice), previous)
        elif ins.op in (Op.LOAD, Op.RECV):
            base = next((out[q] for q in range(p + 1, len(stream))
                         if stream[q].op in COMPUTE_OPS and out[q] is not None), previous)
        else:
            base = Origin(last_action, rank) if last_action is not None else None
        if base is None:
            base = Origin(last_action, rank)
        out[p] = Origin(base.action, rank, implied=True)
    return out

