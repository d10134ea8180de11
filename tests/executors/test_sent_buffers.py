"""What a rank sends is freed once it is on its way, not at the end of the step: the stage
runtime keeps only its output's gradient edge, and on gloo (whose send works say they are
completed only once waited on) a thread waits on the sends and lets go of each tensor."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from tests.compiler.frontend.harness import tiny_model
from tpc.compiler.frontend import SlicedModel
from tpc.executors.dist_transport import SendReaper
from tpc.compiler.programs.stage_programs import StagePrograms
from tpc.executors.stage_runtime import StageRuntime


class _Work:
    """A send's work that completes when the test says so (or fails)."""

    def __init__(self, error: Exception | None = None):
        self.done, self.error = threading.Event(), error

    def wait(self, timeout=None):
        assert self.done.wait(10)
        if self.error is not None:
            raise self.error
        return True


def _storage_alive(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    ref = StorageWeakRef(t.untyped_storage())
    return lambda: not ref.expired()


def test_the_reaper_lets_go_of_a_tensor_when_its_send_completes():
    reaper = SendReaper(timeout=10)
    first, second = _Work(), _Work()
    a, b = torch.ones(1000), torch.ones(1000)
    alive_a, alive_b = _storage_alive(a), _storage_alive(b)
    reaper.add(first, a, "the send of a")
    reaper.add(second, b, "the send of b")
    del a, b
    gc.collect()
    assert alive_a() and alive_b()  # both still in flight
    first.done.set()
    for _ in range(200):
        if not alive_a():
            break
        threading.Event().wait(0.01)
    assert not alive_a() and alive_b()  # the first freed while the second is still in flight
    second.done.set()
    assert reaper.drain() is None
    gc.collect()
    assert not alive_b()


def test_the_reaper_reports_the_first_failure_at_drain():
    reaper = SendReaper(timeout=10)
    bad, good = _Work(RuntimeError("Connection closed by peer")), _Work()
    bad.done.set()
    good.done.set()
    reaper.add(bad, torch.ones(3), "the send of act stage 0 mb 1 slice 0 to rank 1")
    reaper.add(good, torch.ones(3), "the send of act stage 0 mb 2 slice 0 to rank 1")
    what, e = reaper.drain()
    assert what == "the send of act stage 0 mb 1 slice 0 to rank 1" and "Connection closed" in str(e)
    assert reaper.drain() is None  # reported once


def test_the_reaper_thread_ends_with_its_transport():
    before = {t for t in threading.enumerate() if t.name == "tpc-send-reaper"}
    reaper = SendReaper(timeout=10)
    mine = {t for t in threading.enumerate() if t.name == "tpc-send-reaper"} - before
    assert len(mine) == 1
    del reaper
    gc.collect()
    (thread,) = mine
    thread.join(5)
    assert not thread.is_alive()


@pytest.mark.parametrize("split", [False, True])
def test_a_stage_keeps_no_activation_it_sent_and_its_backward_is_unchanged(split):
    sm = SlicedModel.from_model(tiny_model("gpt"), seq_len=16, vocab=256)
    stage = sm.stage_module(1, 2)

    def run(keep: bool):
        torch.manual_seed(0)
        for p in stage.parameters():
            p.grad = None
        rt = StageRuntime(stage, 1.0, StagePrograms(stage) if split else None)
        x = torch.randn(2, 8, sm.hidden_size)
        out = rt.forward(0, 0, x, 0, None, capacity=16)
        alive = _storage_alive(out)
        g = torch.randn_like(out)
        kept = out if keep else None
        del out
        gc.collect()
        held = alive()
        if split:
            rt.backward_input(0, 0, g)
            rt.backward_weight(0, 0)
        else:
            rt.backward(0, 0, g)
        del kept
        return held, {n: p.grad.clone() for n, p in stage.named_parameters()}

    held, grads = run(keep=False)
    assert not held  # the runtime did not hold the activation it returned
    _, reference = run(keep=True)
    for n in reference:
        torch.testing.assert_close(grads[n], reference[n], rtol=0, atol=0)
