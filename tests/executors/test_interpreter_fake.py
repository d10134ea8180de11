"""The reference interpreter on a fake causal LM (running-sum KV cache): gradients equal plain
autograd for every schedule, stage count, slicing and micro-batch count; hand-edited plans
(checkpointing, split backward, deadlocks, broken streams) behave as docs/ir.md says."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch

from tests.executors.fake import FakeLM, fake_factory, fake_header, fake_plan, reference
from tpc.executors.training.batches import RandomTokens
from tpc.executors.options import RunOptions
from tpc.executors.oracle import relative_error
from tpc.executors.interpreter import interpret
from tpc.executors.training.optimizer import OptimSpec, build_optimizer
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Instr, Op, RankProgram
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan

TOL = 1e-5



def run_fake(plan, steps=1, optim=None, model=None, verify=True, **kw):
    """`interpret` of the fake LM; `kw` are RunOptions fields."""
    torch.manual_seed(0)
    model = model or FakeLM(n_layer=2, tie=bool(plan.header.ties))
    options = RunOptions(steps=steps, optim=optim or OptimSpec("sgd", lr=0.1), **{"lr_schedule": "constant", **kw})
    result = interpret(plan, options, model=model, stage_factory_for=fake_factory, hidden_size=8,
                       verify=verify)
    return model, result


def assert_matches_autograd(plan, model, result):
    h = plan.header
    tokens = RandomTokens(0, h.shape.batch, h.shape.seq, h.shape.vocab).get(0)
    loss, grads = reference(model, tokens)
    assert abs(result.losses[0] - loss) <= TOL * abs(loss)
    assert set(result.grads) == set(grads)
    worst = max(relative_error(result.grads[n], g) for n, g in grads.items())
    assert worst <= TOL, worst


CASES = list(itertools.product(["gpipe", "1f1b", "terapipe", "seq1f1b"], [1, 2, 4], ["1", "3", "8", "2,7,3"], [1, 4]))


@pytest.mark.parametrize("comm", ["gloo", "nccl"])
@pytest.mark.parametrize("schedule,stages,slices,mbs", CASES)
def test_gradients_match_autograd(schedule, stages, slices, mbs, comm):
    """Under gloo's buffered rules and under NCCL's (a send completes only when its receive is
    posted; the plan's exchanges complete together)."""
    plan = fake_plan(schedule=schedule, stages=stages, slices=slices, microbatches=mbs, tie=True, n_layer=2)
    model, result = run_fake(plan, comm=comm)
    assert_matches_autograd(plan, model, result)


@pytest.mark.parametrize("schedule", ["gpipe", "terapipe"])
def test_several_stages_per_rank(schedule):
    plan = fake_plan(schedule=schedule, stages=4, ranks=[0, 1, 0, 1], slices="3", microbatches=2, tie=True)
    model, result = run_fake(plan)
    assert_matches_autograd(plan, model, result)


@pytest.mark.parametrize("schedule", ["1f1b", "seq1f1b"])
def test_data_parallel_replicas(schedule):
    plan = fake_plan(schedule=schedule, stages=2, slices="3", microbatches=2, dp=2, batch=8, tie=True)
    assert any(i.op is Op.ALLREDUCE for i in plan.ranks[0].instrs)
    model, result = run_fake(plan)
    assert_matches_autograd(plan, model, result)


def test_weights_after_several_steps_match_plain_training():
    plan = fake_plan(schedule="seq1f1b", stages=2, slices="2,7,3", microbatches=2, tie=True)
    spec = OptimSpec("adamw", lr=1e-2, weight_decay=0.1)
    model, result = run_fake(plan, steps=3, optim=spec)
    ref = copy.deepcopy(model)
    opt = build_optimizer(ref.named_parameters(), spec)
    losses = []
    for step in range(3):
        tokens = RandomTokens(0, 4, 12, plan.header.shape.vocab).get(step)
        loss, grads = reference(ref, tokens)
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        opt.step()
        losses.append(loss)
    assert result.losses == pytest.approx(losses, rel=TOL)
    for n, p in ref.named_parameters():
        assert relative_error(result.state_dict[n], p.detach()) <= TOL, n
    # training moved the weights: the comparison above is not between two untouched copies
    assert relative_error(result.state_dict["layers.0.w"], model.layers[0].w.detach()) > 1e-3


def test_clipping_and_lr_schedule_match_plain_training():
    from functools import partial

    from tpc.executors.training.lr import lr_at

    plan = fake_plan(schedule="1f1b", stages=3, slices="3", microbatches=2, tie=True)
    spec, clip, steps = OptimSpec("sgd", lr=0.5), 0.05, 3
    schedule = partial(lr_at, peak=spec.lr, warmup=2, total=steps)
    model, result = run_fake(plan, steps=steps, optim=spec, lr_schedule="cosine", warmup=2, grad_clip=clip)
    ref = copy.deepcopy(model)
    opt = build_optimizer(ref.named_parameters(), spec)
    for step in range(steps):
        _, grads = reference(ref, RandomTokens(0, 4, 12, plan.header.shape.vocab).get(step))
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        assert norm > clip  # clipping changes these steps
        opt.set_lr(schedule(step))
        opt.step()
    for n, p in ref.named_parameters():
        assert relative_error(result.state_dict[n], p.detach()) <= TOL, n


def _rewrite(plan, rank, fn):
    """The plan with rank `rank`'s instruction list replaced by fn(list)."""
    ranks = list(plan.ranks)
    ranks[rank] = RankProgram(rank=rank, instrs=tuple(fn(list(plan.ranks[rank].instrs))))
    return dataclasses.replace(plan, ranks=tuple(ranks))


def test_checkpoint_and_recompute():
    plan = fake_plan(schedule="1f1b", stages=2, slices="3", microbatches=2)

    def checkpoint_all(instrs):
        out = []
        for ins in instrs:
            if ins.op is Op.BACKWARD:
                out.append(Instr(Op.RECOMPUTE, stage=ins.stage, mb=ins.mb, slice=ins.slice))
            out.append(dataclasses.replace(ins, checkpoint=True) if ins.op is Op.FORWARD else ins)
        return out

    edited = _rewrite(plan, 0, checkpoint_all)
    model, result = run_fake(edited)
    assert_matches_autograd(edited, model, result)
    _, plain = run_fake(plan)
    assert result.peak_live[0] < plain.peak_live[0]  # a checkpointed forward keeps no graph


def test_split_backward():
    plan = fake_plan(schedule="seq1f1b", stages=2, slices="3", microbatches=2, tie=True)

    def split(instrs):
        out, weights = [], []
        for ins in instrs:
            if ins.op is Op.BACKWARD:
                out.append(Instr(Op.BACKWARD_INPUT, stage=ins.stage, mb=ins.mb, slice=ins.slice))
                weights.append(Instr(Op.BACKWARD_WEIGHT, stage=ins.stage, mb=ins.mb, slice=ins.slice))
            elif ins.op in (Op.FREE_KV, Op.REDUCE_TIED, Op.STEP) and weights:
                out += weights  # weight gradients deferred to the end, as zero-bubble schedules do
                weights = []
                out.append(ins)
            else:
                out.append(ins)
        return out

    edited = _rewrite(_rewrite(plan, 0, split), 1, split)
    model, result = run_fake(edited)
    assert_matches_autograd(edited, model, result)


def _located(plan):
    """The plan printed and parsed again, so every instruction has a line number."""
    return parse(print_plan(plan), file="edited.tpir")


def _line(plan, rank, op, payload=None):
    ins = next(i for i in plan.ranks[rank].instrs if i.op is op and (payload is None or i.payload == payload))
    return ins.loc.line, str(ins)


def test_a_plan_safe_only_with_buffered_sends_deadlocks_under_nccl_rules():
    """1F1B lowered for gloo runs with buffered sends; under NCCL's rules each rank's first
    steady-state send waits for the other's, and the interpreter names both lines."""
    from tpc.compiler.lowering.lower import lower
    from tpc.compiler.schedules import build_schedule

    header = fake_header(schedule="1f1b", stages=2, slices="1", microbatches=3)
    plan = _located(lower(header, build_schedule("1f1b", header), comm="gloo"))
    model, result = run_fake(plan)  # gloo's rules: fine
    assert_matches_autograd(plan, model, result)
    with pytest.raises(TpirError) as err:
        run_fake(plan, verify=False, comm="nccl")
    head = err.value.diagnostics[0].message
    sends = {r: [i for i in plan.ranks[r].instrs if i.op is Op.SEND] for r in (0, 1)}
    # rank 0 is past its first send (mb 0, received at once) and waits at the next instruction
    assert "deadlock" in head and "rank 0 line" in head and "rank 1 line" in head, head
    texts = "\n".join(d.message for d in err.value.diagnostics[1:])
    assert f"the send of act stage 1 mb 1 slice 0: rank 1 has not posted its receive" in texts, texts
    assert f"the send of grad stage 0 mb 0 slice 0: rank 0 has not posted its receive" in texts, texts
    assert len(sends[0]) == 3 and len(sends[1]) == 3
    # with the plan's exchanges (lowered for NCCL, the default) the same run is exact
    paired = fake_plan(schedule="1f1b", stages=2, slices="1", microbatches=3)
    model, result = run_fake(paired, comm="nccl")
    assert_matches_autograd(paired, model, result)


def test_deadlock_lists_every_stuck_rank():
    plan = fake_plan(schedule="1f1b", stages=2, slices="1", microbatches=1)

    def recv_first(instrs):  # rank 0 waits for the gradient before it sends the activation
        recv = next(i for i in instrs if i.op is Op.RECV)
        rest = [i for i in instrs if i is not recv]
        return [rest[0], recv, *rest[1:]]

    edited = _located(_rewrite(plan, 0, recv_first))
    with pytest.raises(TpirError) as err:
        run_fake(edited, verify=False)
    text = str(err.value)
    assert "deadlock" in text
    lines = {}
    for rank in (0, 1):
        line, instr = _line(edited, rank, Op.RECV)
        lines[rank] = line
        assert f"rank {rank}, line {line}: {instr}: blocked" in text
    assert len(err.value.diagnostics) == 3  # the deadlock and one per stuck rank, at its line
    # the wait-for cycle, in the first diagnostic
    assert (f"rank 0 line {lines[0]} waits for rank 1 line {lines[1]}, which waits for rank 0 "
            f"line {lines[0]}") in err.value.diagnostics[0].message


def test_error_inside_an_instruction_is_located():
    plan = fake_plan(schedule="gpipe", stages=2, slices="3", microbatches=1)
    # rank 1 loses its first forward: the send of its gradient later finds nothing to send
    edited = _located(_rewrite(plan, 1, lambda ins: [i for i in ins if not (i.op is Op.FORWARD and i.slice == 0)]))
    bad = next(i for i in edited.ranks[1].instrs if i.op is Op.FORWARD)  # slice 1 without slice 0's cache
    with pytest.raises(TpirError) as err:
        run_fake(edited, verify=False)
    assert f"rank 1, line {bad.loc.line}: {bad}: " in str(err.value)
    assert err.value.diagnostics[0].loc == bad.loc


def test_out_of_order_message_is_reported():
    plan = fake_plan(schedule="gpipe", stages=2, slices="3", microbatches=1)

    def swap_recvs(instrs):
        idx = [k for k, i in enumerate(instrs) if i.op is Op.RECV]
        instrs[idx[0]], instrs[idx[1]] = instrs[idx[1]], instrs[idx[0]]
        return instrs

    edited = _located(_rewrite(plan, 1, swap_recvs))
    with pytest.raises(TpirError, match="received in the order they were sent|not act stage 1 mb 0 slice 1"):
        run_fake(edited, verify=False)


def test_verifier_runs_first():
    plan = fake_plan(schedule="gpipe", stages=2, slices="1", microbatches=1)
    broken = _rewrite(plan, 0, lambda ins: [i for i in ins if i.op is not Op.SEND])
    with pytest.raises(TpirError, match="send"):
        run_fake(broken)


def test_seq1f1b_holds_fewer_activations_than_terapipe():
    peaks = {}
    for schedule in ("terapipe", "seq1f1b"):
        plan = fake_plan(schedule=schedule, stages=2, slices="4", microbatches=4, tie=True)
        peaks[schedule] = run_fake(plan)[1].peak_live
    assert max(peaks["seq1f1b"]) < max(peaks["terapipe"])
    assert max(peaks["terapipe"]) == 16  # every slice of every micro-batch before the first backward


def test_trace_events():
    plan = _located(fake_plan(schedule="1f1b", stages=2, slices="3", microbatches=2))
    _, result = run_fake(plan, trace=True)
    assert len(result.events) == sum(len(r.instrs) for r in plan.ranks)
    ev = result.events[0]
    assert ev.end >= ev.start and ev.instr == str(plan.ranks[ev.rank].instrs[0])
    assert ev.line == plan.ranks[ev.rank].instrs[0].loc.line
