"""The distributed executor (gloo on 127.0.0.1, one process per rank) on the fake LM: the same
loss and gradients as the interpreter and as plain autograd, the same weights as plain training
after several steps, and bounded, explained exits when a rank dies or fails."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from tests.executors.dist_harness import launch
from tests.executors.dist_harness import run_cases as harness_run_cases
from tests.executors.fake import FakeLM, fake_factory, fake_plan, reference
from tests.executors.fake_ranks import run_buffered_only, run_cases, run_with_fault
from tpc.executors.training.batches import RandomTokens
from tpc.executors.options import RunOptions
from tpc.executors.oracle import relative_error
from tpc.executors.interpreter import interpret
from tpc.executors.training.optimizer import OptimSpec, build_optimizer

pytestmark = pytest.mark.slow

TOL = 1e-5
TIMEOUT = 20.0

TWO_RANKS = [dict(plan=dict(schedule=s, stages=2, slices="2,7,3", microbatches=2, tie=True))
             for s in ("1f1b", "terapipe", "seq1f1b")]
TWO_RANKS.append(dict(plan=dict(schedule="seq1f1b", stages=2, slices="3", microbatches=2, tie=True),
                      steps=3, optim=("adamw", 1e-2, 0.1)))
# clipping by the global norm (summed over the pipeline ranks, the tie counted once) and a
# warm-up/cosine learning rate
TWO_RANKS.append(dict(plan=dict(schedule="1f1b", stages=2, slices="3", microbatches=2, tie=True),
                      steps=3, optim=("sgd", 0.5), clip=0.05, warmup=2))
# NCCL's rules on gloo (`comm="nccl"`: the NCCL branch of DistTransport, tags=False, receives at
# their instruction, each exchange one batch_isend_irecv, every send and exchange complete before
# the rank goes on, as a rendezvous): the plans tpc compiles for GPUs, run as a GPU runs them
NCCL_TWO = [dict(plan=dict(schedule=s, stages=2, slices="2,7,3", microbatches=3, tie=True), comm="nccl")
            for s in ("1f1b", "seq1f1b", "zb-h2")]
NCCL_TWO.append(dict(plan=dict(schedule="interleaved", stages=4, ranks=[0, 1, 0, 1], slices="3",
                               microbatches=2, tie=True), comm="nccl"))
NCCL_TWO.append(dict(plan=dict(schedule="1f1b", stages=2, slices="3", microbatches=2, tie=True),
                     steps=3, optim=("adamw", 1e-2, 0.1), clip=0.05, warmup=2, comm="nccl"))
TWO_RANKS += NCCL_TWO
FOUR_RANKS = [dict(plan=dict(schedule=s, stages=2, slices="3", microbatches=2, dp=2, batch=8, tie=True))
              for s in ("1f1b", "terapipe", "seq1f1b")]
FOUR_RANKS += [dict(plan=dict(schedule=s, stages=4, slices="3", microbatches=4, tie=True))
               for s in ("1f1b", "terapipe", "seq1f1b")]
FOUR_RANKS += [dict(plan=dict(schedule=s, stages=4, slices="2,7,3", microbatches=4, tie=True), comm="nccl")
               for s in ("1f1b", "seq1f1b")]
FOUR_RANKS.append(dict(plan=dict(schedule="seq1f1b", stages=2, slices="3", microbatches=3, dp=2, batch=12,
                                 tie=True), comm="nccl"))
# several steps with data parallelism: from the second step on the gradients live in the
# all-reduce's flat buffer (zeroed in place by the optimizer, accumulated into by backward)
FOUR_RANKS.append(dict(plan=dict(schedule="1f1b", stages=2, slices="3", microbatches=2, dp=2, batch=8, tie=True),
                       steps=3, optim=("adamw", 1e-2, 0.1)))



def _launch_cases(tmp_path_factory, world, cases):
    out = tmp_path_factory.mktemp(f"world{world}")
    return harness_run_cases(out, world, run_cases, cases, TIMEOUT, limit=150)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch_cases(tmp_path_factory, 2, TWO_RANKS)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch_cases(tmp_path_factory, 4, FOUR_RANKS)


def _interpreted(case):
    plan = fake_plan(**case["plan"])
    torch.manual_seed(0)
    model = FakeLM(n_layer=2, tie=case["plan"].get("tie", False))
    spec = OptimSpec(*case.get("optim", ("sgd", 0.1)))
    options = RunOptions(steps=case.get("steps", 1), optim=spec, grad_clip=case.get("clip", 0.0),
                         lr_schedule="cosine" if "warmup" in case else "constant",
                         warmup=case.get("warmup", 0), comm=case.get("comm"))
    result = interpret(plan, options, model=model, stage_factory_for=fake_factory, hidden_size=8)
    return plan, model, result


def _check_case(case, ranks):
    plan, model, interp = _interpreted(case)
    h = plan.header
    ref_loss, ref_grads = reference(copy.deepcopy(model), RandomTokens(0, h.shape.batch, h.shape.seq, h.shape.vocab).get(0))
    for outcome in ranks:
        # every rank reports the global loss of every step, equal to the interpreter's
        assert outcome["losses"] == pytest.approx(interp.losses, rel=1e-6)
        assert abs(outcome["losses"][0] - ref_loss) <= TOL * abs(ref_loss)
        for name, g in outcome["first_grads"].items():
            assert relative_error(g, ref_grads[name]) <= TOL, name
            assert relative_error(g, interp.first_grads[name]) <= 1e-6, name
    held = set().union(*(o["first_grads"] for o in ranks))
    assert held == set(ref_grads)


@pytest.mark.parametrize("i", range(3))
def test_two_ranks_gradients(two_ranks, i):
    _check_case(TWO_RANKS[i], two_ranks[i])


def test_two_ranks_weights_after_several_steps(two_ranks):
    case, ranks = TWO_RANKS[3], two_ranks[3]
    _check_case(case, ranks)
    torch.manual_seed(0)
    ref = FakeLM(n_layer=2, tie=True)
    start = copy.deepcopy(ref)
    opt = build_optimizer(ref.named_parameters(), OptimSpec(*case["optim"]))
    for step in range(case["steps"]):
        _, grads = reference(ref, RandomTokens(0, 4, 12, 11).get(step))
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        opt.step()
    final = dict(ref.named_parameters())
    for outcome in ranks:
        for name, value in outcome["params"].items():
            assert relative_error(value, final[name].detach()) <= TOL, name
    assert relative_error(final["layers.1.w"].detach(), start.layers[1].w.detach()) > 1e-3  # it trained


def test_two_ranks_clipping_and_lr_schedule(two_ranks):
    from functools import partial

    from tpc.executors.training.lr import lr_at

    case, ranks = TWO_RANKS[4], two_ranks[4]
    _check_case(case, ranks)
    torch.manual_seed(0)
    ref = FakeLM(n_layer=2, tie=True)
    spec = OptimSpec(*case["optim"])
    schedule = partial(lr_at, peak=spec.lr, warmup=case["warmup"], total=case["steps"])
    opt = build_optimizer(ref.named_parameters(), spec)
    for step in range(case["steps"]):
        _, grads = reference(ref, RandomTokens(0, 4, 12, 11).get(step))
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), case["clip"]) > case["clip"]
        opt.set_lr(schedule(step))
        opt.step()
    final = dict(ref.named_parameters())
    for outcome in ranks:
        for name, value in outcome["params"].items():
            assert relative_error(value, final[name].detach()) <= TOL, name


@pytest.mark.parametrize("i", range(5, 5 + len(NCCL_TWO)))
def test_two_ranks_under_nccl_rules(two_ranks, i):
    """The exchanges of 1F1B, seq1F1B, ZB-H2 and interleaved stages, one batch_isend_irecv each,
    with every send a rendezvous: the same loss and gradients as autograd and the interpreter."""
    case = TWO_RANKS[i]
    assert case["comm"] == "nccl"
    plan = fake_plan(**case["plan"])
    assert any(ins.op.value == "exchange" for rp in plan.ranks for ins in rp.instrs)
    _check_case(case, two_ranks[i])


@pytest.mark.parametrize("i", range(len(FOUR_RANKS)))
def test_four_ranks_gradients(four_ranks, i):
    _check_case(FOUR_RANKS[i], four_ranks[i])


FAULT_CASE = dict(plan=dict(schedule="1f1b", stages=3, slices="3", microbatches=2))


def test_killed_rank_makes_the_others_exit_with_a_message(tmp_path):
    timeout = 10.0
    codes, errs = launch(3, tmp_path, run_with_fault, FAULT_CASE, 1, 6, "kill", timeout, limit=240)
    assert codes[1] == -9  # the victim, killed mid-step
    # the others gave up by themselves (a rank still waiting at the limit is killed: code None)
    assert codes[0] == 1 and codes[2] == 1, errs
    for r in (0, 2):
        # names the rank, the instruction it was blocked on and the step
        assert re.search(rf"rank {r}, instruction \d+: recv \w+ stage \d mb \d slice \d from 1: gave up waiting .* \(step 0\)",
                         errs[r]), errs[r]


def test_a_rank_killed_after_its_last_send_is_said_dead_at_the_survivors_plan_line(tmp_path):
    """Rank 1 dies at its last instruction, after every message rank 0 needs: rank 0 finishes
    its stream and fails summing the step's loss. It said gloo's raw "[.../pair.cc:537] Read
    error ...: Connection reset by peer. ... GLHF!" with no rank, plan line or cause."""
    case = dict(plan=dict(schedule="1f1b", stages=2, slices="1", microbatches=2))
    last = len(fake_plan(**case["plan"]).ranks[1].instrs) - 1
    codes, errs = launch(2, tmp_path, run_with_fault, case, 1, last, "kill", 10.0, limit=90)
    assert codes == [1, -9], errs
    assert re.search(r"rank 0, instruction \d+: step: after the last instruction of rank 0's stream \(step 0\): "
                     r"a peer rank died while this rank waited for the step's loss summed over the ranks "
                     r"\(its connection closed: Connection (reset|closed) by peer\)", errs[0]), errs[0]
    assert "pair.cc" not in errs[0] and "-9: killed" in errs[0]


def test_a_dead_peer_is_said_dead_by_name():
    from tpc.executors.dist_transport import gave_up

    e = RuntimeError("[/x/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5: Connection reset by peer. "
                     "This is typically caused by a remote worker hanging")
    [d] = gave_up("the send of act 0 mb 1 to rank 2 (p.tpir line 12: send act stage 0 mb 1 slice 0 to 1)", e).diagnostics
    assert d.message == ("gave up waiting for the send of act 0 mb 1 to rank 2 (p.tpir line 12: send act stage 0 "
                         "mb 1 slice 0 to 1): rank 2 died (its connection closed: Connection reset by peer)")
    assert "exit status torchrun reports" in d.hint
    [d] = gave_up("the message x from rank 1", RuntimeError("Timed out waiting 10000ms")).diagnostics
    assert d.message == "gave up waiting for the message x from rank 1: Timed out waiting 10000ms"


def test_a_collective_whose_posting_fails_on_a_dead_peer_says_so():
    """A collective can fail as it is posted, not only while waited for: a dead peer is said
    dead there too, with what the rank was summing, never as gloo's raw text."""
    from tpc.executors.dist_transport import DistTransport
    from tpc.ir.diagnostics import TpirError

    def dead(*args, **kwargs):
        raise RuntimeError("[/x/gloo/transport/tcp/pair.cc:537] Connection reset by peer")

    with pytest.raises(TpirError) as e:
        DistTransport.collective(object(), "the gradient of tie 'wte' from the other ranks holding it", dead)
    [d] = e.value.diagnostics
    assert d.message == ("gave up waiting for the gradient of tie 'wte' from the other ranks holding it: a peer "
                         "rank died (its connection closed: Connection reset by peer)")


def test_failing_rank_reports_and_the_others_exit(tmp_path):
    codes, errs = launch(2, tmp_path, run_with_fault, FAULT_CASE | dict(plan=dict(schedule="1f1b", stages=2, slices="3",
                                                                                       microbatches=2)),
                            0, 4, "raise", 10.0, limit=90)
    assert codes == [1, 1], errs
    assert re.search(r"rank 0, instruction 4: .*: RuntimeError: injected failure \(step 0\)", errs[0]), errs[0]
    assert "rank 1, instruction" in errs[1] and "gave up waiting" in errs[1], errs[1]


def test_a_plan_safe_only_with_buffered_sends_hangs_under_nccl_rules_and_is_reported(tmp_path):
    """1F1B lowered for gloo (no exchanges) under NCCL's rules on gloo: each rank's first
    steady-state send waits for a receive the other rank posts only after its own send, as on
    GPUs; both ranks give up after --timeout and say where, instead of hanging."""
    case = dict(plan=dict(schedule="1f1b", stages=2, slices="1", microbatches=3))
    codes, errs = launch(2, tmp_path, run_buffered_only, case, 4.0, limit=90)
    assert codes == [1, 1], errs
    for r, peer in ((0, 1), (1, 0)):
        assert re.search(rf"rank {r}, instruction \d+: send \w+ stage {r} mb \d slice 0 to {peer}: "
                         rf"gave up waiting for the send of .* to rank {peer}", errs[r]), errs[r]
