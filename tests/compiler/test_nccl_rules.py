"""Plans under NCCL's rules (tpc.ir.semantics): a send completes only when its receive is
posted, two ranks' sends and receives share one FIFO, an `exchange` completes together.

The verifier rejects the plan that is safe only with buffered sends (1F1B's steady state without
exchanges), naming both ranks and lines of the wait cycle; lowering makes every schedule's plan
pass, whatever the pipeline size, the slicing, the data parallelism or the stage placement."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import SCHEDULES, build_schedule, placement_of, replicas, stages_per_rank
from tpc.compiler.schedules.placement import PLACEMENTS
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Op
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.verify import verify, verify_file

from . import make_header

UNEQUAL = (5, 11, 1, 7)  # sums to SEQ = 24
ONE_STAGE_PER_RANK = ("1f1b", "seq1f1b", "1f1b-pre-recompute", "1f1b-last-no-recompute", "1f1b-critical-path")  # refuse several stages on a rank
IR_GOLDEN = Path(__file__).parent.parent / "ir" / "golden"
COMPILER_GOLDEN = Path(__file__).parent / "golden"


def _printed(plan):
    """The plan as a file reads: every instruction with its line."""
    return parse(print_plan(plan), file="plan.tpir")


def test_the_buffered_only_exchange_is_rejected_with_both_ranks_and_lines():
    header = make_header(2, mbs=3, schedule="1f1b")
    plan = _printed(lower(header, build_schedule("1f1b", header), comm="gloo"))
    assert verify(plan, "gloo") == []  # fine with buffered sends
    diags = verify(plan, "nccl")
    assert len(diags) == 2, diags
    # rank 0's second activation and rank 1's first gradient: each waits for the other's receive
    at = {r: next(i for i in plan.ranks[r].instrs if i.op is Op.SEND and i.mb == (1 if r == 0 else 0))
          for r in (0, 1)}
    assert str(at[0]) == "send act stage 0 mb 1 slice 0 to 1" and str(at[1]) == "send grad stage 1 mb 0 slice 0 to 0"
    line = {r: at[r].loc.line for r in (0, 1)}
    for d, (r, peer) in zip(diags, ((0, 1), (1, 0))):
        assert d.loc.line == line[r]
        assert d.message == (f"deadlock under NCCL's rules: rank {r} waits here forever for rank "
                             f"{peer} to post the matching receive")
        assert (f"rank {r} line {line[r]} waits for rank {peer} line {line[peer]}, which waits for "
                f"rank {r} line {line[r]}") in d.hint
        assert f"rank {peer} is itself blocked at line {line[peer]} ({at[peer]})" in d.hint
        assert "exchange" in d.hint
    # the same schedule as lowering writes it for NCCL: an exchange at each of those sends
    paired = _printed(lower(header, build_schedule("1f1b", header)))
    assert verify(paired, "nccl") == []
    for r in (0, 1):
        instrs = paired.ranks[r].instrs
        p = next(k for k, i in enumerate(instrs) if i == at[r])
        assert instrs[p - 1].op is Op.EXCHANGE and instrs[p - 1].count == 2
        assert instrs[p + 1].op is Op.RECV and instrs[p + 1].peer == 1 - r


def test_a_deadlock_with_buffered_sends_too_is_reported_as_the_order_s_own():
    """A receive before the send it waits on is wrong under any backend: the buffered message."""
    header = make_header(2, mbs=1, schedule="1f1b")
    plan = lower(header, build_schedule("1f1b", header), comm="gloo")
    instrs = list(plan.ranks[0].instrs)
    recv = next(i for i in instrs if i.op is Op.RECV)
    instrs.remove(recv)
    instrs.insert(1, recv)  # rank 0 waits for the gradient before it sends the activation
    from dataclasses import replace

    broken = _printed(replace(plan, ranks=(replace(plan.ranks[0], instrs=tuple(instrs)), plan.ranks[1])))
    for comm in ("gloo", "nccl"):
        text = "\n".join(d.message for d in verify(broken, comm))
        assert "deadlock" in text and "NCCL" not in text, text


def _grid():
    for name in sorted(n for n in SCHEDULES if replicas(n) == 1):  # tests/compiler/test_schedules_chimera.py
        for pp, slices, dp in itertools.product((2, 4), (1, UNEQUAL), (1, 2)):
            if stages_per_rank(name) == 2:  # a V: two stages on every rank, and no other way
                yield name, pp, 2, slices, dp
                continue
            yield name, pp, 1, slices, dp
            if name not in ONE_STAGE_PER_RANK:
                yield name, pp, 2, slices, dp  # two stages per rank, the schedule's placement


@pytest.mark.parametrize("name", sorted(n for n in SCHEDULES if replicas(n) == 1))
def test_every_schedule_passes_nccl_rules(name):
    """schedule x pp {2, 4} x stages per rank {1, 2} x slices {1, unequal} x dp {1, 2}, each
    printed and read back as `tpc compile` writes it."""
    count = 0
    for _, pp, per_rank, slices, dp in (g for g in _grid() if g[0] == name):
        k = pp * per_rank
        ranks = PLACEMENTS[placement_of(name)](k, pp)
        # dualpipev needs 2 x pp micro-batches
        header = make_header(k, slices=slices, mbs=max(4, 2 * pp), dp=dp, schedule=name, stage_ranks=ranks,
                             ties=(("tied", (0, k - 1)),))
        plan = _printed(lower(header, build_schedule(name, header), verify=False))
        diags = verify(plan, "nccl")
        assert diags == [], f"{name} pp={pp} stages={k} slices={slices} dp={dp}: {diags[0]}"
        count += 1
    assert count == (8 if name in ONE_STAGE_PER_RANK or stages_per_rank(name) == 2 else 16)


def test_lowering_for_gloo_writes_no_exchange_and_nccl_plans_run_under_both():
    header = make_header(4, slices=3, mbs=4, dp=2, schedule="seq1f1b")
    compute = build_schedule("seq1f1b", header)
    gloo = lower(header, compute, comm="gloo")
    nccl = lower(header, compute)
    assert not any(i.op is Op.EXCHANGE for r in gloo.ranks for i in r.instrs)
    assert any(i.op is Op.EXCHANGE for r in nccl.ranks for i in r.instrs)
    assert verify(nccl, "gloo") == [] and verify(nccl, "nccl") == []
    # an exchange of two ranks that must both send first: same messages on both sides
    for r in range(4):
        instrs = nccl.ranks[r].instrs
        for p, ins in enumerate(instrs):
            if ins.op is Op.EXCHANGE:
                members = instrs[p + 1: p + 1 + ins.count]
                assert [m.op for m in members] == sorted((m.op for m in members), key=lambda o: o is Op.RECV)


@pytest.mark.parametrize("path", sorted(IR_GOLDEN.glob("*.tpir")) + sorted(COMPILER_GOLDEN.glob("*.tpir")),
                         ids=lambda p: p.name)
def test_golden_plans_pass_nccl_rules(path):
    verify_file(str(path), "nccl")


EXCHANGE_PLAN = (IR_GOLDEN / "one_f_one_b_exchange.tpir").read_text()


def _first_exchange_line(text: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if line.strip().startswith("exchange"))


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.replace("exchange 2", "exchange 1", 1), "an exchange of 1 instruction"),
    (lambda t: t.replace("exchange 2", "exchange 3", 1), "is inside the `exchange 3`"),
    (lambda t: re.sub(r"(    send act stage 0 mb 1 slice 0 to 1\n)(    recv grad stage 0 mb 0 slice 0 from 1\n)",
                      r"\2\1", t, count=1), "a send after a receive inside the `exchange 2`"),
    (lambda t: t.replace("tpir 2", "tpir 1"), "`exchange` needs format version 2, and this plan says `tpir 1`"),
])
def test_malformed_exchanges_are_located(tmp_path, edit, message):
    text = edit(EXCHANGE_PLAN)
    path = tmp_path / "p.tpir"
    path.write_text(text)
    with pytest.raises(TpirError) as err:
        verify_file(str(path), "gloo")
    hits = [d for d in err.value.diagnostics if message in d.message]
    assert hits, err.value.render()
    assert hits[0].loc.line in range(_first_exchange_line(text), _first_exchange_line(text) + 4)
