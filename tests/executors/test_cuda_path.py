"""The CUDA/NCCL path of the distributed executor, checked on the CPU: how it waits on NCCL work
(never blocking the host), the watchdog that backs those waits, the data-parallel flat buffer
the gradients live in, and how many times the gradient norm reaches the host."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.executors.dist_harness import free_port
from tests.executors.fake import fake_plan
from tpc.executors.dist_transport import DistTransport, Wire
from tpc.executors.world import Groups


class FakeWork:
    """A work handle that records how it is waited on."""

    def __init__(self, done: bool = True):
        self.calls: list[tuple[tuple, dict]] = []
        self.done = done

    def wait(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return True

    def is_completed(self) -> bool:
        return self.done


def _transport(*, wire: Wire, groups: Groups | None = None) -> DistTransport:
    plan = fake_plan(schedule="1f1b", stages=2, slices="3", microbatches=2)
    return DistTransport(plan, 0, groups or Groups(dp=None), wire=wire,
                         device=torch.device("cpu"), hidden_size=8, dtype=torch.float32, timeout=5.0)


def test_nccl_waits_never_block_the_host():
    """WorkNCCL.wait(timeout=...) blocks the host until the work is done; wait() only makes the
    current stream wait. On NCCL the transport calls wait() bare; on gloo with the timeout."""
    nccl, gloo = _transport(wire=Wire.NCCL), _transport(wire=Wire.BUFFERED)
    w1, w2 = FakeWork(), FakeWork()
    nccl.wait(w1, "a receive")
    gloo.wait(w2, "a receive")
    assert w1.calls == [((), {})]
    assert w2.calls == [((), {"timeout": timedelta(seconds=5.0)})]
    assert nccl.blocked_on is None  # nothing marks the host as blocked


def test_the_watchdog_reads_is_completed_of_nccl_work():
    t = _transport(wire=Wire.NCCL)
    stuck, done = FakeWork(done=False), FakeWork(done=True)
    t.wait(done, "the gradient of stage 0")
    t.wait(stuck, "the message act stage 1 mb 0 slice 0 from rank 0")
    assert t.overdue(limit=60.0) is None  # not yet
    time.sleep(0.05)
    assert t.overdue(limit=0.01) == "the message act stage 1 mb 0 slice 0 from rank 0"
    stuck.done = True
    assert t.overdue(limit=0.01) is None
    t.prune()
    assert not t.in_flight


@pytest.fixture
def one_process_group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_allreduce_keeps_one_flat_buffer_the_gradients_live_in(one_process_group):
    t = _transport(wire=Wire.BUFFERED, groups=Groups(dp=one_process_group))
    a, b = torch.randn(3, 4), torch.randn(5)
    want = [a.clone(), b.clone()]
    views = t.allreduce(0, [a, b])
    assert views is not None and [tuple(v.shape) for v in views] == [(3, 4), (5,)]
    assert all(torch.equal(v, w) for v, w in zip(views, want))
    flat = t.flat[0]
    ptr = flat.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == ptr for v in views)
    # the next step accumulates into the views (zeroed in place by the optimizer): no new buffer
    for v in views:
        v.zero_().add_(1.0)
    assert t.allreduce(0, views) is None
    assert t.flat[0] is flat and flat.untyped_storage().data_ptr() == ptr
    assert torch.equal(flat, torch.ones(17))
    # other tensors than its views: a new buffer, the values copied in
    c = torch.full((17,), 2.0)
    assert t.allreduce(0, [c]) is not None and torch.equal(t.flat[0], c)


def test_clipping_by_the_gradient_norm_never_reads_the_device():
    from tpc.executors.host_sync import HostSyncMonitor
    from tpc.executors.training.clip import clip_global, grad_norm, local_sq_norm

    params = [(f"p{k}", torch.nn.Parameter(torch.randn(4, 4))) for k in range(5)]
    for _, p in params:
        p.grad = torch.randn(4, 4)
    # the rank's share stays on the gradients' device (here: meta, which has no host copy), and
    # so do the pipeline's sum and the factor: the step reads the sum once, with its loss
    meta = [(n, torch.nn.Parameter(torch.empty(4, 4, device="meta"))) for n, _ in params]
    for _, p in meta:
        p.grad = torch.empty(4, 4, device="meta")
    assert local_sq_norm(meta).device.type == "meta"
    assert clip_global(meta, 1e-3, sum_over_pipeline=lambda t: t).device.type == "meta"
    want = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for _, p in params)))
    with HostSyncMonitor() as monitor:
        total = clip_global(params, 1e-3, sum_over_pipeline=lambda t: t)
    assert not monitor.syncs, monitor.report()
    assert grad_norm(total) == pytest.approx(want, rel=1e-6)
    clipped = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for _, p in params)))
    assert clipped == pytest.approx(1e-3, rel=1e-4)


def test_an_exchange_is_one_batch_and_its_receive_is_waited_where_it_is_used(monkeypatch):
    """On NCCL an exchange's sends and receives go out as one batch_isend_irecv at its first
    receive; the receive (moved up to its send by lowering) is not waited on at its line but
    where the engine uses the value, so the computes in between overlap the transfer."""
    from tpc.executors import distributed
    from tpc.ir.nodes import Op
    from tpc.ir.semantics import message

    batches = []

    def batch_isend_irecv(ops):
        batches.append(ops)
        return [FakeWork() for _ in ops]

    monkeypatch.setattr(distributed.dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(distributed.dist, "P2POp", lambda op, tensor, peer: (op, tensor, peer))
    t = _transport(wire=Wire.NCCL)
    instrs = t.instrs
    at = next(p for p, i in enumerate(instrs) if i.op is Op.EXCHANGE)
    send, recv = instrs[at + 1], instrs[at + 2]
    assert (send.op, recv.op) == (Op.SEND, Op.RECV)
    t.exchange(at, instrs[at].count)
    out = torch.randn(2, 4, 8)
    t.send(message(send), out, send.peer, at + 1)
    assert batches == []  # collected until the exchange's receive
    buf = t.recv(message(recv), recv.peer, None, torch.float32, at + 2)
    assert len(batches) == 1 and [op[0] for op in batches[0]] == [distributed.dist.isend, distributed.dist.irecv]
    assert batches[0][0][1] is out and batches[0][1][1] is buf
    assert message(recv) in t.deferred
    work = t.deferred[message(recv)][0]
    assert work.calls == []  # not at its line
    t.claim(message(recv))  # the engine uses the value
    assert work.calls == [((), {})] and not t.deferred


@pytest.mark.parametrize("rendezvous", [False, True], ids=["nccl", "nccl-rules-on-gloo"])
def test_under_nccl_rules_every_send_and_receive_is_a_batch(monkeypatch, rendezvous):
    """PyTorch's NCCL process group gives unbatched isend/irecv a lazily created communicator
    per pair of ranks, and batched ones the group's: mixing them put one pair's messages on two
    streams and hung 1F1B on the first GPU run (docs/benchmarks.md, 'GPU: the first run'). Under
    NCCL's rules each plain send and receive is a batch of one, and nothing else is issued."""
    from tpc.executors import distributed
    from tpc.ir.nodes import Op
    from tpc.ir.semantics import message

    batches, plain = [], []

    def batch_isend_irecv(ops):
        batches.append([op[0] for op in ops])
        return [FakeWork() for _ in ops]

    monkeypatch.setattr(distributed.dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(distributed.dist, "P2POp", lambda op, tensor, peer: (op, tensor, peer))
    monkeypatch.setattr(distributed.dist, "isend", lambda *a, **k: plain.append("isend") or FakeWork())
    monkeypatch.setattr(distributed.dist, "irecv", lambda *a, **k: plain.append("irecv") or FakeWork())
    for rank in (0, 1):
        plan = fake_plan(schedule="1f1b", stages=2, slices="3", microbatches=2)
        t = DistTransport(plan, rank, Groups(dp=None), wire=Wire.RENDEZVOUS if rendezvous else Wire.NCCL,
                          device=torch.device("cpu"), hidden_size=8, dtype=torch.float32, timeout=5.0)
        ops = {Op.SEND: 0, Op.RECV: 0}
        for p, ins in enumerate(t.instrs):
            t.before_instruction(p)
            if ins.op is Op.EXCHANGE:
                t.exchange(p, ins.count)
            elif ins.op is Op.SEND:
                t.send(message(ins), torch.zeros(2, 4, 8), ins.peer, p)
                ops[Op.SEND] += 1
            elif ins.op is Op.RECV:
                t.recv(message(ins), ins.peer, None, torch.float32, p)
                ops[Op.RECV] += 1
        assert ops[Op.SEND] and ops[Op.RECV]
        issued = [op for batch in batches for op in batch]
        assert issued.count(distributed.dist.isend) == ops[Op.SEND]
        assert issued.count(distributed.dist.irecv) == ops[Op.RECV]
        batches.clear()
    assert plain == []
