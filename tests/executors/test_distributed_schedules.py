"""The new schedules and recomputation under the distributed executor (gloo, one process per
rank): every new schedule x {1, 3 equal, unequal slices} with two chunks per rank on two ranks
(GRID), and a few more: split backward with one chunk, recomputation, pipeline x data parallel,
NCCL's rules on gloo, the V-shaped zbv and dualpipev each with 1 slice, 3 slices and
unequal slices between the two groups, and chimera's two pipelines over weight replicas. Each rank's loss and gradients equal plain autograd
(<= 1e-5) and the interpreter's (<= 1e-6). One process group per world size runs every case."""

from __future__ import annotations

import pytest

from tests.executors.test_distributed_models import _check, _launch

pytestmark = pytest.mark.slow


def _plan(schedule, **kw):
    return dict(schedule=schedule, slices="2,9,5", microbatches=2, seq_len=16) | kw


TWO = [
    dict(plan=_plan("interleaved", stages=4, ranks=2)),
    dict(plan=_plan("seq-zb", stages=4, ranks=2, recompute={0: "full", 1: "none", 2: "none", 3: "none"})),
    dict(plan=_plan("zb-h2", stages=2, slices="3", microbatches=3, batch=6, recompute="full")),
    # the V (stage i and 3-i on rank i): 1 slice and unequal slices, then pp x dp below
    dict(plan=_plan("zbv", stages=4, ranks=2, slices="1", microbatches=3, batch=6)),
    dict(plan=_plan("dualpipev", stages=4, ranks=2, microbatches=4)),
    dict(plan=_plan("dualpipev", stages=4, ranks=2, microbatches=4, slices="3")),
]
NEW = ["interleaved", "looped-bfs", "zb-h1", "zb-h2", "seq-zb", "seq-interleaved"]
GRID = [dict(plan=_plan(schedule, stages=4, ranks=2, slices=slices)) for schedule in NEW for slices in ("1", "3", "2,9,5")]
# under NCCL's rules on gloo (`comm="nccl"`): the NCCL branch of the executor, each exchange one
# batch_isend_irecv, every send complete before its rank goes on
TWO += [
    dict(plan=_plan("interleaved", stages=4, ranks=2), comm="nccl"),
    dict(plan=_plan("zb-h2", stages=2, slices="3", microbatches=3, batch=6), comm="nccl"),
]
FOUR = [  # pipe 2 x data 2
    dict(plan=_plan("seq-zb", stages=2, dp=2, batch=8)),
    dict(plan=_plan("seq-interleaved", stages=4, ranks=2, dp=2, batch=8)),
    dict(plan=_plan("seq-interleaved", stages=4, ranks=2, dp=2, batch=8), comm="nccl"),
    dict(plan=_plan("zbv", stages=4, ranks=2, dp=2, batch=8, slices="3")),
    dict(plan=_plan("zbv", stages=4, ranks=2, dp=2, batch=8)),
    dict(plan=_plan("dualpipev", stages=4, ranks=2, dp=2, batch=8, microbatches=4, slices="1")),
    # chimera: two pipelines over weight replicas, on the untied tiny Llama: 4 ranks x {1, 3,
    # unequal slices}, and pipe 2 x data 2; then on the tied tiny GPT (embedding = head, its
    # tie reduced once over both replicas of both tied stages): pipe 2 x data 2, and 4 ranks
    # under NCCL's rules
    *[dict(model="llama", plan=_plan("chimera", stages=4, batch=8, microbatches=4, slices=s))
      for s in ("1", "3", "2,9,5")],
    dict(model="llama", plan=_plan("chimera", stages=2, dp=2, batch=8, microbatches=2, slices="2,9,5")),
    dict(model="llama", plan=_plan("chimera", stages=4, batch=8, microbatches=4), comm="nccl"),
    dict(plan=_plan("chimera", stages=2, dp=2, batch=8, microbatches=2, slices="3")),
    dict(plan=_plan("chimera", stages=4, batch=8, microbatches=4), comm="nccl"),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """TWO and GRID: one launch of two ranks runs both lists."""
    return _launch(tmp_path_factory, 2, TWO + GRID)


@pytest.fixture(scope="module")
def two(two_ranks):
    return two_ranks[:len(TWO)]


@pytest.fixture(scope="module")
def grid(two_ranks):
    return two_ranks[len(TWO):]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch(tmp_path_factory, 4, FOUR)


@pytest.mark.parametrize("i", range(len(TWO)))
def test_two_ranks(two, i):
    _check(TWO[i], two[i])


@pytest.mark.parametrize("i", range(len(GRID)), ids=lambda i: f"{GRID[i]['plan']['schedule']}-{GRID[i]['plan']['slices']}")
def test_every_new_schedule_and_slicing(grid, i):
    _check(GRID[i], grid[i])


@pytest.mark.parametrize("i", range(len(FOUR)))
def test_pipe_by_data(four, i):
    _check(FOUR[i], four[i])
