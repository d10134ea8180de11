"""`--exchanges ordered`: NCCL's exchanges lowered as single sends and receives in an order NCCL's
rendezvous rules run (compiler/lowering/lower.py, `order_exchanges`).

Every schedule the compiler ships x pipeline ranks {2, 4} x stages per rank x slices {1, 3,
unequal} x dp {1, 2} lowers to a plan with no `exchange` that the verifier passes under NCCL's
rules, its evaluation program too, with the batched plan's operations reordered only inside
each exchange (and its receives moved down towards their consumers); in a pair of ranks the
lower sends first, in a ring the lowest; the plan says on its `schedule` line how it was
lowered; an order in which both ranks send first is a deadlock the verifier reports, and
lowering refuses one, naming the schedule and the ranks."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tpc.compiler.lowering.eval_program import eval_program
from tpc.compiler.lowering.lower import ORDERED_NOTE, Exchanges, check_ordered, lower
from tpc.compiler.options import check_options
from tpc.compiler.schedules import SCHEDULES, build_schedule, placement_of, replicas, stages_per_rank, with_replicas
from tpc.compiler.schedules.placement import PLACEMENTS
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import COMPUTE_OPS, Op
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.verify import verify

from . import make_header

UNEQUAL = (5, 11, 1, 7)  # sums to SEQ = 24
ONE_STAGE_PER_RANK = ("1f1b", "seq1f1b", "1f1b-pre-recompute", "1f1b-last-no-recompute", "1f1b-critical-path")


def _printed(plan):
    return parse(print_plan(plan), file="plan.tpir")


def _headers(name):
    """schedule x pp {2, 4} x stages per rank (1, and 2 where the schedule places several) x
    slices {1, 3, unequal} x dp {1, 2}."""
    for pp, slices, dp in itertools.product((2, 4), (1, 3, UNEQUAL), (1, 2)):
        if replicas(name) == 2:  # two pipelines over weight replicas, untied
            yield with_replicas(make_header(pp, slices=slices, mbs=4, dp=dp, schedule=name))
            continue
        per_rank = (2,) if stages_per_rank(name) == 2 else (1,) if name in ONE_STAGE_PER_RANK else (1, 2)
        for chunks in per_rank:
            k = pp * chunks
            # dualpipev needs 2 x pp micro-batches
            yield make_header(k, slices=slices, mbs=max(4, 2 * pp), dp=dp, schedule=name,
                              stage_ranks=PLACEMENTS[placement_of(name)](k, pp), ties=(("tied", (0, k - 1)),))


def _groups(instrs):
    """The batched stream cut into what ordering may permute: each exchange's members, and
    every other instruction alone."""
    out, p = [], 0
    while p < len(instrs):
        if instrs[p].op is Op.EXCHANGE:
            out.append(instrs[p + 1: p + 1 + instrs[p].count])
            p += 1 + instrs[p].count
        else:
            out.append((instrs[p],))
            p += 1
    return out


WORK = COMPUTE_OPS | {Op.LOAD, Op.FREE_KV}  # what an exchange's receive may sink past


def _same_but_within_exchanges(batched, ordered):
    """`ordered` is `batched` without its `exchange` lines: the computes, loads and free-kvs in
    the same order, and the sends, receives and collectives in the same order but for each
    exchange's members, permuted (a receive may have sunk past computes towards its consumer)."""
    for b, o in zip(batched, ordered):
        assert [i for i in o.instrs if i.op in WORK] == [i for i in b.instrs if i.op in WORK]
        comm = [i for i in o.instrs if i.op not in WORK]
        at = 0
        for group in _groups([i for i in b.instrs if i.op not in WORK]):
            mine = comm[at: at + len(group)]
            assert sorted(map(str, mine)) == sorted(map(str, group)), (b.rank, at, group, mine)
            at += len(group)
        assert at == len(comm)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_passes_nccl_rules_with_ordered_exchanges(name):
    """The evaluation program included; the first of each schedule's plans printed and read
    back as `tpc compile` writes it."""
    count = split = 0
    for header in _headers(name):
        compute = build_schedule(name, header)
        batched = lower(header, compute, verify=False)
        plan = lower(header, compute, verify=False, exchanges="ordered")
        plan = dataclasses.replace(plan, eval=eval_program(plan.header, None, "nccl", Exchanges.ORDERED))
        assert not any(i.op is Op.EXCHANGE for p in (*plan.ranks, *plan.eval.ranks) for i in p.instrs)
        if count == 0:  # as `tpc compile` writes it (printing and parsing cost more than the rest)
            text = print_plan(plan)
            assert "exchange" not in text.replace(ORDERED_NOTE, "")
            plan = parse(text, file="plan.tpir")
        diags = verify(plan, "nccl")
        where = f"{name} {header.mesh} slices {header.microbatches[0].lengths}"
        assert diags == [], f"{where}: {diags[0].render()}"
        _same_but_within_exchanges(batched.ranks, plan.ranks)
        _same_but_within_exchanges(eval_program(header, None, "nccl").ranks, plan.eval.ranks)
        split += sum(i.op is Op.EXCHANGE for r in batched.ranks for i in r.instrs)
        count += 1
    assert count == {"chimera": 12, "chimera-doubling": 12}.get(name, 12 if name in ONE_STAGE_PER_RANK or stages_per_rank(name) == 2 else 24)
    # gpipe and terapipe send one way at a time: nothing to order
    assert (split == 0) == (name in ("gpipe", "terapipe")), split


def _member_order(name, pp, chunks=1):
    """For each exchange of the batched plan: (rank, peers, its members in the ordered plan's
    order)."""
    k = pp * chunks
    header = make_header(k, mbs=2 * pp, schedule=name, stage_ranks=PLACEMENTS[placement_of(name)](k, pp))
    compute = build_schedule(name, header)
    batched = lower(header, compute)
    ordered = lower(header, compute, exchanges="ordered")
    out = []
    for b, o in zip(batched.ranks, ordered.ranks):
        for group in _groups(b.instrs):
            if len(group) > 1:
                members = sorted(group, key=o.instrs.index)
                out.append((b.rank, {m.peer for m in members}, members))
    return out


def test_in_a_pair_of_ranks_the_lower_sends_first_and_the_higher_receives_first():
    groups = _member_order("1f1b", 2)
    assert groups
    for rank, peers, members in groups:
        ops = [m.op for m in members]
        assert ops == ([Op.SEND, Op.RECV] if rank < min(peers) else [Op.RECV, Op.SEND]), (rank, peers, ops)


def test_in_a_ring_the_lowest_rank_sends_first_and_the_messages_go_in_sender_order():
    """Looped placement on 3 ranks: activations go round 0 -> 1 -> 2 -> 0, gradients 2 -> 1 -> 0
    -> 2, each rank sending before it receives. Ordered, rank 0's message goes first, then the
    others by sender rank: forward, ranks 1 and 2 receive first; backward, rank 1 sends its
    message to 0 (which rank 0 takes after its own send) and only rank 2 receives first."""
    groups = [g for g in _member_order("looped-bfs", 3, chunks=2) if len(g[1]) == 2]
    assert len(groups) == 36
    firsts = set()
    for rank, peers, members in groups:
        forward = {m.payload.value for m in members} == {"act"}
        send_first = rank == 0 or (rank == 1 and not forward)
        assert members[0].op is (Op.SEND if send_first else Op.RECV), (rank, forward, members)
        firsts.add((rank, forward, members[0].op))
    assert len(firsts) == 6  # both rings on every rank


def test_an_ordered_plan_says_so_on_its_schedule_line_and_reads_back():
    header = make_header(2, mbs=3, schedule="1f1b")
    plan = lower(header, build_schedule("1f1b", header), exchanges="ordered")
    text = print_plan(plan)
    assert f'schedule "1f1b"  # {ORDERED_NOTE}\n' in text
    assert print_plan(parse(text, file="p.tpir")) == text
    assert ORDERED_NOTE not in print_plan(lower(header, build_schedule("1f1b", header)))
    # under gloo's rules there is nothing to order: the option changes nothing
    gloo = lower(header, build_schedule("1f1b", header), comm="gloo", exchanges="ordered")
    assert gloo == lower(header, build_schedule("1f1b", header), comm="gloo")


def _both_send_first():
    """1F1B on 2 ranks, ordered, with rank 1's receives moved after its sends where rank 0 sends
    first: both ranks send first, as an exchange split carelessly would."""
    header = make_header(2, mbs=3, schedule="1f1b")
    plan = lower(header, build_schedule("1f1b", header), exchanges="ordered")
    instrs = list(plan.ranks[1].instrs)
    for p in range(len(instrs) - 1):
        if instrs[p].op is Op.RECV and instrs[p + 1].op is Op.SEND:
            instrs[p], instrs[p + 1] = instrs[p + 1], instrs[p]
    ranks = (plan.ranks[0], dataclasses.replace(plan.ranks[1], instrs=tuple(instrs)))
    return header, dataclasses.replace(plan, ranks=ranks)


def test_both_ranks_sending_first_is_a_deadlock_the_verifier_reports():
    _, plan = _both_send_first()
    plan = _printed(plan)
    assert verify(plan, "gloo") == []  # buffered sends do not care
    diags = verify(plan, "nccl")
    assert len(diags) == 2, diags
    for d, (r, peer) in zip(diags, ((0, 1), (1, 0))):
        assert d.message == (f"deadlock under NCCL's rules: rank {r} waits here forever for rank "
                             f"{peer} to post the matching receive")
        at = next(i for i in plan.ranks[r].instrs if i.loc.line == d.loc.line)
        assert at.op is Op.SEND, at


def test_lowering_refuses_an_order_that_blocks_naming_the_schedule_and_the_ranks():
    header, plan = _both_send_first()
    with pytest.raises(TpirError) as err:
        check_ordered(header, {r.rank: r.instrs for r in plan.ranks})
    d = err.value.diagnostics[0]
    assert d.where == "--exchanges"
    assert "schedule '1f1b'" in d.message and "ranks 0 and 1" in d.message, d.message
    assert "rank 0 at `send act stage 0 mb 1 slice 0 to 1`" in d.message, d.message
    assert "rank 1 at `send grad stage 1 mb 0 slice 0 to 0`" in d.message, d.message
    assert "--exchanges batched" in d.hint
    check_ordered(header, {r.rank: r.instrs for r in lower(header, build_schedule("1f1b", header),
                                                          exchanges="ordered").ranks})  # passes


def test_the_option_is_checked_with_the_others():
    base = dict(seq_len=24, batch=4)
    assert check_options(**base).exchanges is Exchanges.BATCHED
    assert check_options(**base, exchanges="Ordered").exchanges is Exchanges.ORDERED
    with pytest.raises(TpirError) as err:
        check_options(**base, exchanges="paired")
    assert err.value.diagnostics[0].where == "--exchanges" and "batched" in err.value.diagnostics[0].hint
    with pytest.raises(TpirError) as err:
        check_options(**base, exchanges="ordered", comm="gloo")
    assert "--comm gloo" in err.value.diagnostics[0].message


def test_compile_help_says_what_each_choice_does(capsys):
    from tpc.cli.main import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["compile"]
    text = " ".join(sub.format_help().split())
    assert "--exchanges {batched,ordered}" in text
    assert "(default: batched)" in text and "the lower sends first" in text


def test_a_receive_moved_up_to_its_exchange_goes_back_down_to_the_next_operation():
    """1F1B, 3 slices: rank 0 sends the activation of mb 1 slice 0 and then takes the gradient
    of mb 0 slice 2, which it needs only for its backward after two more forwards. Single, that
    receive would hold the forward after it (NCCL orders the compute after a receive), so it
    sinks to just before the rank's next send; the order of the operations stays."""
    header = make_header(2, slices=3, mbs=4, schedule="1f1b")
    instrs = [str(i) for i in lower(header, build_schedule("1f1b", header), exchanges="ordered").ranks[0].instrs]
    at = instrs.index("recv grad stage 0 mb 0 slice 2 from 1")
    assert instrs[at - 2: at + 2] == ["send act stage 0 mb 1 slice 0 to 1", "forward stage 0 mb 1 slice 1",
                                      "recv grad stage 0 mb 0 slice 2 from 1", "send act stage 0 mb 1 slice 1 to 1"]


def test_a_schedule_file_is_lowered_batched_only():
    from tpc.cli.compile import compile_schedule_from_args
    from tpc.cli.main import build_parser

    args = build_parser().parse_args(["compile", "m.py", "-o", "p.tpir", "--seq-len", "16", "--batch", "2",
                                      "--schedule-file", "s.csv", "--exchanges", "ordered"])
    with pytest.raises(TpirError) as err:  # before any file is read
        compile_schedule_from_args(args)
    d = err.value.diagnostics[0]
    assert d.where == "--exchanges" and "--schedule-file" in d.message and "leave out --exchanges" in d.hint
