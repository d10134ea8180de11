"""Plans lowered `--exchanges ordered` (NCCL's exchanges as single sends and receives in a
deadlock-free order) run exactly: the interpreter under NCCL's rules (each send a rendezvous)
gives plain autograd's loss and gradients for pairs of ranks, a ring of three, split backward
and pipeline x data; the distributed executor on gloo with the rendezvous wire (`comm="nccl"`:
every send and receive a batch of one, each send complete before the rank goes on) gives the
interpreter's and autograd's."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.executors.dist_harness import run_cases
from tests.executors.fake import FakeLM, fake_factory, fake_plan, reference
from tests.executors.fake_ranks import run_cases as fake_rank_cases
from tests.executors.test_interpreter_fake import assert_matches_autograd, run_fake
from tpc.executors.interpreter import interpret
from tpc.executors.options import RunOptions
from tpc.executors.oracle import relative_error
from tpc.executors.training.batches import RandomTokens
from tpc.executors.training.optimizer import OptimSpec
from tpc.ir.nodes import Op

TOL = 1e-5

CASES = {
    "1f1b-pair": dict(schedule="1f1b", stages=2, slices="2,7,3", microbatches=3, tie=True),
    "interleaved-2-ranks": dict(schedule="interleaved", stages=4, ranks=[0, 1, 0, 1], slices="3",
                                microbatches=2, tie=True),
    "seq1f1b-4-ranks": dict(schedule="seq1f1b", stages=4, slices="2,7,3", microbatches=4, tie=True),
    # a ring: rank 0 sends to 1, 1 to 2, 2 to 0, each before it receives
    "looped-bfs-ring": dict(schedule="looped-bfs", stages=6, ranks=[0, 1, 2, 0, 1, 2], slices="3",
                            microbatches=3, batch=6, n_layer=4, tie=True),
    "zb-h2-split-backward": dict(schedule="zb-h2", stages=2, slices="3", microbatches=3, batch=6, tie=True),
    "seq1f1b-pipe-by-data": dict(schedule="seq1f1b", stages=2, slices="3", microbatches=2, dp=2, batch=8,
                                 tie=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_ordered_plans_match_autograd_under_nccl_rules(name):
    kw = CASES[name]
    batched = fake_plan(**kw)
    plan = fake_plan(**kw, exchanges="ordered")
    assert any(i.op is Op.EXCHANGE for r in batched.ranks for i in r.instrs)
    assert not any(i.op is Op.EXCHANGE for r in plan.ranks for i in r.instrs)
    torch.manual_seed(0)
    model, result = run_fake(plan, model=FakeLM(n_layer=kw.get("n_layer", 2), tie=True), comm="nccl")
    assert_matches_autograd(plan, model, result)


# the distributed executor: one process group of two ranks runs both cases
DIST = [dict(plan=CASES["1f1b-pair"] | dict(exchanges="ordered"), comm="nccl"),
        dict(plan=CASES["interleaved-2-ranks"] | dict(exchanges="ordered"), comm="nccl")]


def test_two_gloo_ranks_with_the_rendezvous_wire_match_the_interpreter_and_autograd(tmp_path):
    ranks = run_cases(tmp_path, 2, fake_rank_cases, DIST, 20.0, limit=150)
    for case, outcomes in zip(DIST, ranks):
        plan = fake_plan(**case["plan"])
        torch.manual_seed(0)
        model = FakeLM(n_layer=2, tie=True)
        h = plan.header.shape
        ref_loss, ref_grads = reference(copy.deepcopy(model), RandomTokens(0, h.batch, h.seq, h.vocab).get(0))
        interp = interpret(plan, RunOptions(optim=OptimSpec("sgd", 0.1), lr_schedule="constant", comm="nccl"),
                           model=model, stage_factory_for=fake_factory, hidden_size=8)
        for outcome in outcomes:
            assert outcome["losses"] == pytest.approx(interp.losses, rel=1e-6)
            assert abs(outcome["losses"][0] - ref_loss) <= TOL * abs(ref_loss)
            for name, g in outcome["first_grads"].items():
                assert relative_error(g, ref_grads[name]) <= TOL, name
                assert relative_error(g, interp.first_grads[name]) <= 1e-6, name
        assert set().union(*(o["first_grads"] for o in outcomes)) == set(ref_grads)
