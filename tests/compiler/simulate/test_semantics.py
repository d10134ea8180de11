"""The simulator honours the ordering rules of docs/ir.md and accounts memory by kind."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from tests.compiler.simulate.plans import make_header, make_plan
from tpc.compiler.predict.memory import rank_memory
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.predict.simulate import simulate
from tpc.ir.semantics import GLOO
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import COMPUTE_OPS, Instr, Op, Payload, Plan, RankProgram, Tie
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan


def by_text(result, rank: int, text: str):
    [event] = [e for e in result.events_of(rank) if str(e.instr) == text]
    return event


def test_a_receive_waits_for_its_send_plus_the_transfer():
    result = simulate(make_plan("gpipe", 2, 1), UnitCosts(p2p=0.5), GLOO)
    recv = by_text(result, 1, "recv act stage 1 mb 0 slice 0 from 0")
    assert (recv.start, recv.end, recv.wait) == (0.0, 1.5, 1.5)  # sent at 1, there at 1.5
    assert by_text(result, 1, "forward stage 1 mb 0 slice 0").start == 1.5
    assert by_text(result, 0, "backward stage 0 mb 0 slice 0").start == 5.0  # 4.5 + 0.5
    assert result.iteration_time == 7.0  # 6 of compute + two transfers
    # waiting is idle, not busy
    assert [r.busy for r in result.ranks] == [3.0, 3.0]
    assert [r.bubble for r in result.ranks] == [pytest.approx(4 / 7)] * 2


@dataclass(frozen=True)
class CollectiveCosts(UnitCosts):
    """Unit compute; a fixed all-reduce time for ties and a per-stage gradient sync."""

    def allreduce_time(self, nbytes, n):
        return 3.0

    def tied_bytes(self, name):
        return 64.0

    def grad_sync_time(self, stage, data):
        return 0.25 * (stage + 1) if data > 1 else 0.0


def test_reduce_tied_starts_when_every_rank_of_the_tie_is_there():
    plan = make_plan("gpipe", 3, 1, ties=(Tie("wte", (0, 2)),))
    result = simulate(plan, CollectiveCosts(), GLOO)
    # forwards end at 1, 2, 3; backwards: rank 2 [3,5), rank 1 [5,7), rank 0 [7,9)
    early = by_text(result, 2, 'reduce-tied "wte"')
    late = by_text(result, 0, 'reduce-tied "wte"')
    assert (early.start, early.wait, early.end) == (5.0, 4.0, 12.0)
    assert (late.start, late.wait, late.end) == (9.0, 0.0, 12.0)
    assert result.iteration_time == 12.0
    assert result.ranks[1].busy == 3.0 and result.ranks[0].busy == 6.0  # 3 compute + 3 reduce


def test_allreduce_costs_the_gradient_sync_of_its_stage():
    plan = make_plan("gpipe", 2, 1, data=2)
    result = simulate(plan, CollectiveCosts(), GLOO)
    assert by_text(result, 0, "allreduce stage 0").work == 0.25
    assert by_text(result, 1, "allreduce stage 1").work == 0.5
    assert result.ranks[0].busy == 3.25 and result.ranks[0].compute == 3.0


def test_a_deadlock_names_the_stuck_instruction_of_every_rank():
    header = make_header(2, 1, 1)
    r0 = (Instr(Op.RECV, payload=Payload.GRAD, stage=0, mb=0, slice=0, peer=1),)
    r1 = (Instr(Op.RECV, payload=Payload.ACT, stage=1, mb=0, slice=0, peer=0),)
    plan = Plan(header, (RankProgram(0, r0), RankProgram(1, r1)))
    with pytest.raises(TpirError) as err:
        simulate(plan, UnitCosts(), GLOO)
    text = str(err.value)
    assert len(err.value.diagnostics) == 2
    assert "rank 0 is stuck at instruction 0 `recv grad stage 0 mb 0 slice 0 from 1`" in text
    assert "rank 1 is stuck at instruction 0 `recv act stage 1 mb 0 slice 0 from 0`" in text
    assert all(d.hint for d in err.value.diagnostics)


@pytest.mark.parametrize("schedule,p,m,n,p2p", [
    ("gpipe", 3, 2, 1, 0.0), ("1f1b", 4, 6, 1, 0.25), ("terapipe", 4, 1, 8, 0.1),
    ("seq1f1b", 3, 3, 4, 0.5),
])
def test_the_critical_path_explains_the_iteration_time(schedule, p, m, n, p2p):
    result = simulate(make_plan(schedule, p, m, n), UnitCosts(p2p=p2p), GLOO)
    path = result.critical_path
    assert path[0].start == 0.0
    assert path[-1].end == result.iteration_time
    transfers = 0.0
    for before, after in zip(path, path[1:]):
        if after.rank == before.rank:
            assert after.index == before.index + 1 and after.start == before.end
        elif after.instr.op is Op.RECV:  # a message: the receive ends when the send's data is there
            assert before.instr.op is Op.SEND
            assert after.end == pytest.approx(before.end + p2p)
            transfers += p2p
        else:  # an exchange's receive: the compute using it starts when the data is there
            assert before.instr.op is Op.SEND and after.instr.op in COMPUTE_OPS
            assert after.start + after.wait == pytest.approx(before.end + p2p)
            transfers += p2p
    work = math.fsum(e.work for e in path if e.instr.op is not Op.RECV)
    # a compute that waited for an exchange's receive from the rank before it on the path
    # started its work when the data arrived: its wait is the transfer, counted above
    assert work + transfers == pytest.approx(result.iteration_time)


def test_events_carry_the_plan_line_of_their_instruction():
    text = print_plan(make_plan("1f1b", 2, 2, 2))
    plan = parse(text, file="p.tpir")
    result = simulate(plan, UnitCosts(), GLOO)
    lines = text.splitlines()
    assert len(result.events) == sum(len(r.instrs) for r in plan.ranks)
    for e in result.events:
        assert lines[e.line - 1].strip() == str(e.instr)
        assert e.end >= e.start


@dataclass(frozen=True)
class ByteCosts(UnitCosts):
    """Bytes: parameters 100 per stage index + 1, a boundary activation 1 per token (no stash),
    KV cache 10 per token."""

    def param_bytes(self, stage):
        return 100.0 * (stage + 1)

    def activation_bytes(self, l, mb_size):
        return float(l * mb_size)

    def kv_bytes(self, stage, l, mb_size):
        return 10.0 * l * mb_size


def test_memory_counts_parameters_optimizer_activations_kv_and_kv_gradients():
    plan = make_plan("terapipe", 2, 1, 2)  # slices of 32 tokens
    last = plan.ranks[1].instrs
    mem = rank_memory(plan.header, 1, last, ByteCosts())
    peak = mem.peak
    assert str(last[mem.peak_index]) == "backward stage 1 mb 0 slice 1"
    assert (peak.params, peak.grads, peak.optimizer) == (200, 200, 400)  # Adam: 2x params
    assert peak.activations == 64  # both slices' graphs, the running backward still holds its own
    assert peak.kv == 640
    assert peak.kv_grads == 320  # slice 1's backward sends gradients into slice 0's K/V
    assert peak.total == 1824
    # the runtime allocates a micro-batch's whole KV buffer at its first forward on the stage
    first = next(i for i, ins in enumerate(last) if str(ins) == "forward stage 1 mb 0 slice 0")
    assert mem.during[first].kv == 640 and mem.during[first].kv_grads == 0
    # after free-kv only the step-long state is left
    free = next(i for i, ins in enumerate(last) if ins.op is Op.FREE_KV)
    assert mem.during[free + 1].total == 800
    assert simulate(plan, ByteCosts(), GLOO).ranks[1].peak_memory == peak


def test_checkpointed_forward_keeps_no_graph_until_recompute():
    header = make_header(1, 1, 2)
    f = [Instr(Op.LOAD, mb=0),
         Instr(Op.FORWARD, stage=0, mb=0, slice=0, checkpoint=True),
         Instr(Op.FORWARD, stage=0, mb=0, slice=1, checkpoint=True),
         Instr(Op.RECOMPUTE, stage=0, mb=0, slice=1),
         Instr(Op.BACKWARD, stage=0, mb=0, slice=1),
         Instr(Op.RECOMPUTE, stage=0, mb=0, slice=0),
         Instr(Op.BACKWARD, stage=0, mb=0, slice=0),
         Instr(Op.FREE_KV, stage=0, mb=0),
         Instr(Op.STEP)]
    mem = rank_memory(header, 0, tuple(f), UnitCosts())
    assert [m.activations for m in mem.during] == [0, 0, 0, 1, 1, 1, 1, 0, 0]
    result = simulate(Plan(header, (RankProgram(0, tuple(f)),)), UnitCosts(), GLOO)
    assert result.iteration_time == 2 + 2 + 4  # two forwards, two recomputes, two backwards
