"""The per-rank instruction engine (tpc.executors.engine) on its own, over transports written
here against the `Transport` protocol rather than the interpreter's or torch.distributed's:

- the protocol is all the engine needs: two `RankEngine`s over a minimal in-memory transport,
  driven round-robin, give plain autograd's loss and gradients;
- a transport's `Blocked` leaves the program counter and the environment as they were, so the
  caller may retry;
- every value is freed after its one use (popped from the environment, no reference kept);
- a failing instruction is reported once, located: "rank r, line n: <instruction>: <cause>";
- receives are posted with the shapes the header implies.

The stages are the fake LM's (tests/executors/fake.py): its running-sum cache mixes every earlier
token into each later one, as keys and values do.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque

import pytest
import torch

from tests.executors.fake import HIDDEN, FakeLM, fake_factory, fake_plan, reference
from tpc.executors.engine import Blocked, RankEngine, RankError, measured_trace
from tpc.executors.oracle import relative_error
from tpc.executors.options import RunOptions
from tpc.executors.training.batches import RandomTokens
from tpc.executors.training.optimizer import OptimSpec
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Op, Payload, RankProgram
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.semantics import message

TOL = 1e-5


class Wire:
    """FIFO channels between the pipeline ranks of one replica."""

    def __init__(self):
        self.queues: dict[tuple[int, int], deque] = {}
        self.sent: list = []  # every message, in the order it was sent

    def queue(self, src: int, dst: int) -> deque:
        return self.queues.setdefault((src, dst), deque())


class WireEnd:
    """One rank's end of a `Wire`: the whole `Transport` protocol for one replica without ties
    (nothing to sum), a receive that finds no message raising `Blocked`."""

    def __init__(self, wire: Wire, me: int):
        self.wire, self.me = wire, me
        self.steps: list[int] = []  # the steps the engine started on this transport

    def start_step(self, step):
        self.steps.append(step)

    def before_instruction(self, index):
        pass  # buffered sends: nothing to post ahead or to wait for

    def claim(self, key):
        pass  # a received value is here once its receive returned

    def send(self, key, tensor, dst, index):
        self.wire.queue(self.me, dst).append((key, tensor))
        self.wire.sent.append(key)

    def recv(self, key, src, shape, dtype, index):
        queue = self.wire.queue(src, self.me)
        if not queue:
            raise Blocked(f"waiting for {key} from rank {src}", ranks=(src,))
        got, tensor = queue.popleft()
        assert got == key and tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype
        return tensor

    def allreduce(self, stage, tensors):
        return None  # one replica: the sum is the tensors themselves

    def reduce_tied(self, name, tensor):
        raise AssertionError("these plans have no ties")

    def reduce_replicas(self, stage, tensors):
        raise AssertionError("these plans have no weight replicas")

    def reduce_loss(self, tensor):
        pass  # one replica: the loss is already the sum

    def flush(self):
        pass  # in-memory sends complete at once

    def exchange(self, index, count):
        pass  # buffered sends: the members of an exchange need nothing more

    def sum_over_pipeline(self, tensor):
        raise AssertionError("no gradient norm asked for")


class Zeros(WireEnd):
    """A transport for one rank run alone: every receive is answered with zeros of the asked
    shape (recorded), every send is dropped (its key recorded, its tensor not kept)."""

    def __init__(self):
        super().__init__(Wire(), 0)
        self.shapes: list = []

    def send(self, key, tensor, dst, index):
        self.wire.sent.append(key)

    def recv(self, key, src, shape, dtype, index):
        self.shapes.append((key, tuple(shape), dtype))
        return torch.zeros(shape, dtype=dtype)


def located(plan):
    """The plan printed and read back, so that every instruction knows its line."""
    return parse(print_plan(plan), file="plan.tpir")


def edit(plan, rank, fn):
    """The plan with rank `rank`'s instructions replaced by fn(list of instructions)."""
    ranks = list(plan.ranks)
    ranks[rank] = RankProgram(rank=rank, instrs=tuple(fn(list(plan.ranks[rank].instrs))), loc=plan.ranks[rank].loc)
    return dataclasses.replace(plan, ranks=tuple(ranks))


def engines(plan, transports, model=None, **options):
    model = model or _model()
    opts = RunOptions(optim=OptimSpec("sgd", lr=0.1), **options)
    return model, [RankEngine(plan, r, 0, t, fake_factory(model), hidden_size=HIDDEN, options=opts)
                   for r, t in enumerate(transports)]


def _model():
    torch.manual_seed(0)
    return FakeLM(n_layer=2)


def tokens_of(plan):
    h = plan.header
    return RandomTokens(0, h.shape.batch, h.shape.seq, h.shape.vocab).get(0)


def round_robin(ranks, tokens) -> float:
    """Run every engine's stream once, each until it blocks, then the next; the summed loss."""
    for e in ranks:
        e.begin_step(0, tokens)
    while not all(e.done for e in ranks):
        progress = False
        for e in ranks:
            while not e.done:
                try:
                    e.execute_next()
                except Blocked:
                    break
                progress = True
        assert progress, [str(e.current) for e in ranks]
    return sum(e.end_step() for e in ranks)


@pytest.mark.parametrize("schedule,slices,mbs", [("gpipe", "3", 1), ("seq1f1b", "2,7,3", 2), ("1f1b", "1", 3)])
def test_two_engines_over_a_minimal_transport_match_autograd(schedule, slices, mbs):
    plan = fake_plan(schedule=schedule, stages=2, slices=slices, microbatches=mbs)
    wire = Wire()
    model, ranks = engines(plan, [WireEnd(wire, 0), WireEnd(wire, 1)], record_grads=True)
    reference_model = _model()
    tokens = tokens_of(plan)
    loss = round_robin(ranks, tokens)
    ref_loss, ref_grads = reference(reference_model, tokens)
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    grads = {**ranks[0].grads, **ranks[1].grads}
    assert set(grads) == set(ref_grads)
    assert max(relative_error(grads[n], g) for n, g in ref_grads.items()) <= TOL
    # every send of the plan went over the wire, in each rank's program order; nothing is left
    for r in (0, 1):
        mine = [message(i) for i in plan.ranks[r].instrs if i.op is Op.SEND]
        assert [k for k in wire.sent if k in set(mine)] == mine
    assert not any(wire.queues.values())
    # the step updated the weights (plain SGD, lr 0.1)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), dict(reference_model.named_parameters())[n].detach()
                                   - 0.1 * ref_grads[n], rtol=TOL, atol=1e-7)


def test_blocked_leaves_the_program_counter_and_the_environment():
    plan = fake_plan(schedule="gpipe", stages=2, slices="3", microbatches=1)
    wire = Wire()
    _, (r0, r1) = engines(plan, [WireEnd(wire, 0), WireEnd(wire, 1)])
    tokens = tokens_of(plan)
    r0.begin_step(0, tokens)
    r1.begin_step(0, tokens)
    # rank 1 loads its targets, then waits for an activation that nothing has sent yet
    while r1.current.op is not Op.RECV:
        r1.execute_next()
    pc, first = r1.pc, r1.current
    with pytest.raises(Blocked) as blocked:
        r1.execute_next()
    assert blocked.value.ranks == (0,) and "from rank 0" in blocked.value.waiting_for
    assert r1.pc == pc and r1.current is first and r1.env == {}
    with pytest.raises(Blocked):  # as often as asked, nothing changes
        r1.execute_next()
    assert r1.pc == pc
    # once rank 0 has sent, the same instruction completes
    while r0.current.op is not Op.SEND:
        r0.execute_next()
    r0.execute_next()
    r1.execute_next()
    assert r1.pc == pc + 1 and list(r1.env) == [message(first)]


def test_every_value_is_freed_after_its_one_use():
    """After a compute's consumer ran (the send of an activation, the next stage's forward on the
    same rank, the send of an input gradient), the engine holds no reference to the value: it is
    freed there and then, by reference counting (no garbage collection is run)."""
    plan = fake_plan(schedule="gpipe", stages=3, ranks=[0, 0, 1], slices="3", microbatches=2, n_layer=2)
    transport = Zeros()
    watched: dict = {}  # message -> weak reference to the tensor the environment held
    freed_at: dict = {}

    def watch(engine, index):
        for key, value in engine.env.items():
            watched.setdefault(key, weakref.ref(value))
        for key, ref in watched.items():
            if key not in engine.env and key not in freed_at:
                assert ref() is None, f"{key} is used but still referenced at instruction {index}"
                freed_at[key] = index

    model = _model()
    opts = RunOptions(optim=OptimSpec("sgd", lr=0.1))
    engine = RankEngine(plan, 0, 0, transport, fake_factory(model), hidden_size=HIDDEN, options=opts,
                        before_instr=watch)
    engine.run_step(0, tokens_of(plan))
    assert engine.env == {}
    # values handed from stage 0 to stage 1 on this rank, received gradients and sent ones
    kinds = {(k.payload, k.receiver_stage) for k in watched}
    assert {(Payload.ACT, 1), (Payload.GRAD, 1), (Payload.GRAD, 0)} <= kinds, kinds
    assert set(freed_at) == set(watched)


def test_values_nobody_used_are_reported_at_the_end_of_the_stream():
    plan = located(fake_plan(schedule="gpipe", stages=2, slices="3", microbatches=1))
    dropped = next(i for i in plan.ranks[0].instrs if i.op is Op.SEND)
    edited = edit(plan, 0, lambda ins: [i for i in ins if i is not dropped])
    _, (engine,) = engines(edited, [Zeros()])
    with pytest.raises(TpirError, match=r"rank 0: the stream ended with values nobody used: "
                                        + str(message(dropped))):
        engine.run_step(0, tokens_of(plan))


def test_receives_are_posted_with_the_shapes_the_header_implies():
    plan = fake_plan(schedule="1f1b", stages=2, slices="2,7,3", microbatches=2, batch=5)
    transport = Zeros()
    _, (engine,) = engines(plan, [transport])
    engine.run_step(0, tokens_of(plan))
    h = plan.header
    assert len(transport.shapes) == sum(i.op is Op.RECV for i in plan.ranks[0].instrs)
    for key, shape, dtype in transport.shapes:
        lo, hi = h.microbatches[key.mb].slices[key.slice]
        assert shape == (h.microbatches[key.mb].size, hi - lo, HIDDEN) and dtype == torch.float32
    assert {h.microbatches[m].size for m in (0, 1)} == {3, 2}  # uneven micro-batches are covered


def test_an_error_inside_an_instruction_is_located_once():
    plan = located(fake_plan(schedule="gpipe", stages=2, slices="3", microbatches=1))
    target = 4

    def fail(engine, index):
        if index == target:
            raise ValueError("boom")

    _, (engine,) = engines(plan, [Zeros()])
    engine.before_instr = fail
    with pytest.raises(RankError) as err:
        engine.run_step(0, tokens_of(plan))
    instr = plan.ranks[0].instrs[target]
    d = err.value.diagnostics[0]
    assert d.message == f"rank 0, line {instr.loc.line}: {instr}: ValueError: boom (step 0)"
    assert d.loc == instr.loc and isinstance(err.value.__cause__, ValueError)
    assert engine.pc == target  # the failed instruction is where the engine stopped

    # an error already located at a rank passes through as it is, not wrapped a second time
    already = RankError(Diagnostic("rank 7: somewhere else"))

    def located_fail(engine, index):
        if index == target:
            raise already

    engine.before_instr = located_fail
    with pytest.raises(RankError) as err:
        engine.run_step(0, tokens_of(plan))
    assert err.value is already


@pytest.mark.parametrize("breakage,cause", [
    ("drop the first recv", "the input activation (act stage 1 mb 0 slice 0) is not available"),
    ("receive twice", "act stage 1 mb 0 slice 0 is produced twice before it is used"),
    ("a stage of another rank", "stage 0 does not run on rank 1"),
    ("drop the load", "micro-batch 0 is not loaded"),
])
def test_a_broken_stream_names_the_instruction_and_what_is_missing(breakage, cause):
    plan = located(fake_plan(schedule="gpipe", stages=2, slices="3", microbatches=1))
    instrs = list(plan.ranks[1].instrs)
    recv = next(i for i in instrs if i.op is Op.RECV)
    forward = next(i for i in instrs if i.op is Op.FORWARD)
    if breakage == "drop the first recv":
        instrs.remove(recv)
        bad = forward
    elif breakage == "receive twice":
        instrs.insert(instrs.index(recv), recv)
        bad = recv
    elif breakage == "a stage of another rank":
        bad = dataclasses.replace(forward, stage=0)
        instrs[instrs.index(forward)] = bad
    else:
        instrs = [i for i in instrs if i.op is not Op.LOAD]
        bad = forward
    edited = edit(plan, 1, lambda _: instrs)
    _, (_, engine) = engines(edited, [Zeros(), Zeros()])
    with pytest.raises(RankError) as err:
        engine.run_step(0, tokens_of(plan))
    where = f"line {bad.loc.line}" if bad.loc is not None else f"instruction {instrs.index(bad)}"
    assert err.value.diagnostics[0].message.startswith(f"rank 1, {where}: {bad}: {cause}"), \
        err.value.diagnostics[0].message


def test_trace_events_and_the_measured_trace():
    plan = located(fake_plan(schedule="1f1b", stages=2, slices="3", microbatches=2))
    wire = Wire()
    _, ranks = engines(plan, [WireEnd(wire, 0), WireEnd(wire, 1)], trace=True)
    round_robin(ranks, tokens_of(plan))
    events = [e for r in ranks for e in r.events]
    assert len(events) == sum(len(p.instrs) for p in plan.ranks)
    for r in ranks:
        assert [e.line for e in r.events] == [i.loc.line for i in plan.ranks[r.pipe_rank].instrs]
        assert all(e.end >= e.start for e in r.events)
    trace = measured_trace(events)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(events) and {e["pid"] for e in xs} == {0, 1}
    assert [e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"] == ["rank 0", "rank 1"]
