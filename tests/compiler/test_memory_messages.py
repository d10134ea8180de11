"""Received messages in a rank's memory: a receive's buffer exists from the instruction it is
posted at (`semantics.RecvAhead`, what the distributed executor posts by on gloo) to the end of
the compute that uses it; what a rank sends is not counted."""

from __future__ import annotations

from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.predict.memory import rank_memory
from tpc.compiler.predict.simulate import simulate
from tpc.ir.nodes import COMPUTE_OPS, Op, Payload
from tpc.ir.semantics import GLOO, NCCL, RecvAhead
from tests.ir.plans import simple_plan


class _Bytes(UnitCosts):
    """Unit costs whose messages weigh 1 each (the textbook model counts none)."""

    def message_bytes(self, l, mb_size):
        return 1.0


def _posted_at(instrs, computes, max_bytes=RecvAhead.MAX_BYTES, nbytes=lambda j: 1):
    """receive index -> the index it is posted before, walking the stream as a rank does."""
    ahead, at = RecvAhead(instrs, nbytes, computes, max_bytes), {}
    for i, ins in enumerate(instrs):
        for j in ahead.before(i):
            at[j] = i
        if ins.op is Op.RECV:
            at.setdefault(i, i)  # not posted ahead: at its own instruction
            ahead.post(i)
            ahead.taken(i)
    return at


def test_receives_are_posted_up_to_the_computes_ahead_and_never_past_a_barrier():
    instrs = simple_plan(2, 4, 1).program(1).instrs  # gpipe, last rank: 4 receives, 4 forwards, ...
    at = _posted_at(instrs, 2)
    recvs = [i for i, ins in enumerate(instrs) if ins.op is Op.RECV]
    assert set(at) == set(recvs)
    for j, i in at.items():
        assert i <= j
        between = sum(instrs[k].op in COMPUTE_OPS for k in range(i, j))
        assert between < 2, (j, i)  # within the 2 computes ahead of where it was posted
        assert not any(instrs[k].op in RecvAhead._BARRIERS for k in range(i, j))
    # 0 computes ahead: each receive at its own instruction (NCCL's rules)
    assert _posted_at(instrs, 0) == {j: j for j in recvs}


def test_the_bytes_bound_holds_back_all_but_the_receive_at_hand():
    instrs = simple_plan(2, 4, 1).program(1).instrs
    recvs = [i for i, ins in enumerate(instrs) if ins.op is Op.RECV]
    # room for one buffer at a time: each receive waits until the one before it was taken
    at = _posted_at(instrs, 8, max_bytes=1)
    assert at[recvs[0]] == 0
    for a, b in zip(recvs, recvs[1:]):
        assert at[b] > a


def test_a_message_counts_from_its_post_to_the_end_of_its_compute():
    plan = simple_plan(2, 4, 1)
    instrs = plan.program(1).instrs
    ahead = rank_memory(plan.header, 1, instrs, _Bytes(), recv_ahead=8)
    own = rank_memory(plan.header, 1, instrs, _Bytes(), recv_ahead=0)
    at = _posted_at(instrs, 8)
    for i, ins in enumerate(instrs):
        # messages during i: posted at or before i, whose forward has not ended before i
        live = sum(1 for j, p in at.items() if p <= i and _consumer(instrs, j) >= i)
        assert ahead.during[i].messages == live, (i, ins)
        live_own = sum(1 for j in at if j <= i and _consumer(instrs, j) >= i)
        assert own.during[i].messages == live_own, (i, ins)
    assert ahead.peak.messages >= own.peak.messages > 0


def _consumer(instrs, j):
    r = instrs[j]
    ops = (Op.FORWARD,) if r.payload is Payload.ACT else (Op.BACKWARD, Op.BACKWARD_INPUT)
    return next(k for k in range(j + 1, len(instrs)) if instrs[k].op in ops and instrs[k].key == r.key)


def test_gradients_received_count_until_their_backward_and_sends_not_at_all():
    plan = simple_plan(2, 2, 2, schedule="1f1b")
    first = plan.program(0).instrs  # receives gradients only, sends activations
    mem = rank_memory(plan.header, 0, first, _Bytes(), recv_ahead=0)
    for i, ins in enumerate(first):
        if ins.op is Op.RECV:
            assert ins.payload is Payload.GRAD and mem.during[i].messages >= 1
        if ins.op is Op.SEND:
            before = mem.during[i - 1].messages if i else 0
            assert mem.during[i].messages <= before  # a send adds nothing


def test_the_simulator_counts_them_under_gloo_posting_ahead_and_under_nccl_not():
    plan = simple_plan(2, 4, 1)
    gloo, nccl = simulate(plan, _Bytes(), GLOO), simulate(plan, _Bytes(), NCCL)
    assert gloo.ranks[1].peak_memory.messages > nccl.ranks[1].peak_memory.messages > 0
    # the textbook model counts slice activations only
    assert simulate(plan, UnitCosts(), GLOO).ranks[1].peak_memory.messages == 0
