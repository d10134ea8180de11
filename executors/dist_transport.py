"""The distributed executor's transport: point-to-point and collectives over torch.distributed
for one rank's engine, under the rules of the backend (tpc.ir.semantics; the `Wire`).

- gloo's buffered rules (`Wire.BUFFERED`, the default on the CPU): receives are posted early
  (`irecv` into a buffer of the shape the plan implies, as `semantics.RecvAhead` says) and
  waited on just before the instruction that needs them; sends are `isend`s whose work handles
  a thread waits on, letting go of each tensor as its send completes (`SendReaper`), and the
  rank waits for them all before `step`; the n-th message of a channel carries tag n, so a
  mismatch could never be matched silently. An `exchange` changes nothing there;
- NCCL (`Wire.NCCL`, on CUDA) and NCCL's rules on gloo (`Wire.RENDEZVOUS`, `--comm nccl` on the
  CPU): each receive is issued at its own instruction (see `before_instruction`), matched by
  order, and each `exchange N` is one `batch_isend_irecv` of its sends and receives, issued at
  its first receive (its sends are collected until then). On NCCL no wait blocks the host:
  `wait()` orders the CUDA stream, and the watchdog reads `is_completed()`. Under
  `Wire.RENDEZVOUS` every send and exchange is waited on before the next instruction, the
  rendezvous NCCL's rules describe, so the CPU tests run the path and the rules a GPU run takes;
- `allreduce stage S`: one flat buffer per stage (not one call per parameter), kept from step
  to step with the stage's gradients living in it, summed in place over the data-parallel group
  of this pipeline rank;
- `reduce-tied NAME`: the tied gradient summed over the ranks of this replica that hold the tie.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from contextlib import contextmanager
from datetime import timedelta
from enum import Enum

import torch
import torch.distributed as dist

from tpc.executors.world import Groups, backend_cause
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Op, Plan
from tpc.ir.semantics import GLOO, NCCL, CommRules, Message, RecvAhead, message_shape


class Wire(Enum):
    """How a process's point-to-point traffic runs: its backend and the rules of the run, as one
    value (`Wire.of`)."""

    BUFFERED = "gloo's buffered sends"  # gloo under gloo's rules: tags, receives posted ahead
    NCCL = "NCCL"  # NCCL itself: batches in issue order; waits order the stream, not the host
    RENDEZVOUS = "NCCL's rules on gloo"  # gloo under NCCL's rules: each send waited at once

    @staticmethod
    def of(backend: str, rules: CommRules | str) -> "Wire":
        rules = CommRules.of(rules)
        if backend == "nccl":
            if rules is not NCCL:
                raise ValueError("NCCL runs under NCCL's rules only")
            return Wire.NCCL
        return Wire.BUFFERED if rules is GLOO else Wire.RENDEZVOUS


class Channels:
    """How many messages this process has sent to and posted receives from each global rank:
    the tag of the next one (gloo's buffered rules). Shared by the transports of one process."""

    def __init__(self):
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}

    def next_sent(self, dst: int) -> int:
        tag = self.sent.get(dst, 0)
        self.sent[dst] = tag + 1
        return tag

    def next_received(self, src: int) -> int:
        tag = self.received.get(src, 0)
        self.received[src] = tag + 1
        return tag


# what gloo (and the OS under it) says when the process at the other end of a connection is gone
_PEER_GONE = ("connection reset", "connection closed", "broken pipe", "socket closed", "connection refused",
              "end of file", "eof", "no route to host")


def peer_gone(cause: str) -> bool:
    """Whether a backend's error says the other end's process went away (killed, crashed)."""
    text = cause.lower()
    return any(words in text for words in _PEER_GONE)


def gave_up(what: str, e: BaseException) -> TpirError:
    """The error of a wait on a peer that failed: what was waited for, and what the backend's
    cause means. A reset connection is the peer's death, said so (gloo says only "Connection
    reset by peer"); the peer is the rank `what` names ("... from rank 2")."""
    cause = backend_cause(e)
    if peer_gone(cause):
        named = re.search(r"\b(?:from|to) rank (\d+)", what)
        who = f"rank {named.group(1)}" if named else "a peer rank"
        return TpirError(Diagnostic(
            f"gave up waiting for {what}: {who} died (its connection closed: {cause})",
            hint=f"{who} ended before this rank could go on: its own error above, or the exit "
                 "status torchrun reports for it (-9: killed, e.g. out of memory), says why"))
    return TpirError(Diagnostic(f"gave up waiting for {what}: {cause}",
                                hint="that rank failed or is stuck: see its own error above; if it is "
                                     "merely slow, raise --timeout"))


class SendReaper:
    """A thread that waits on gloo's sends in the order they were made and lets go of each
    tensor as its send completes.

    A gloo send's work reports completion only once waited on (`is_completed()` stays False
    until then), and waiting in the rank's own thread could block it on a peer that has not
    posted the receive yet. So this thread waits, and the rank waits for it at `flush` (before
    `step`): a sent activation or gradient is freed when it is on its way, not at the end of
    the step. The first failure is kept for `drain` to report. The thread ends when its
    transport is gone (a process may run several plans)."""

    def __init__(self, timeout: float):
        import queue

        self.timeout = timedelta(seconds=timeout)
        self.queue: queue.Queue = queue.Queue()
        self.failures: list[tuple[str, BaseException]] = []
        threading.Thread(target=self._loop, args=(self.queue, self.timeout, self.failures),
                         name="tpc-send-reaper", daemon=True).start()

    def __del__(self):
        self.queue.put(None)

    def add(self, work, tensor: torch.Tensor, what: str) -> None:
        self.queue.put((work, tensor, what))

    def drain(self) -> tuple[str, BaseException] | None:
        """Wait until every send added so far completed (or failed); the first failure."""
        self.queue.join()
        failed = self.failures[0] if self.failures else None
        self.failures.clear()
        return failed

    @staticmethod
    def _loop(queue, timeout, failures) -> None:  # holds no reference to the reaper itself
        while True:
            item = queue.get()
            if item is None:
                queue.task_done()
                return
            work, tensor, what = item
            del item
            try:
                work.wait(timeout=timeout)
            except Exception as e:  # noqa: BLE001 - reported by `drain`
                failures.append((what, e))
            del work, tensor
            queue.task_done()


class DistTransport:
    """Point-to-point and collectives over torch.distributed for one rank's engine."""

    # gloo: receives are posted ahead by `semantics.RecvAhead` (up to the 8th compute from here,
    # while the posted buffers hold at most 16 MiB); the memory model counts each buffer from
    # where it is posted
    LOOKAHEAD_COMPUTES = RecvAhead.COMPUTES
    LOOKAHEAD_BYTES = RecvAhead.MAX_BYTES

    def __init__(self, plan: Plan, rank: int, groups: Groups, *, wire: Wire, device: torch.device,
                 hidden_size: int, dtype: torch.dtype, timeout: float, channels: Channels | None = None):
        """This transport runs global rank `rank`'s stream of `plan` over `wire` (the `Wire`
        docstring). `channels`: the message counts of another transport of this process (the
        plans of a bundle), so the n-th message of a channel has tag n whichever plan sends it."""
        self.plan, self.header = plan, plan.header
        self.mesh = plan.header.mesh.value
        self.pipe_rank, self.data_rank = self.mesh.pipe_rank(rank), self.mesh.data_rank(rank)
        self.instrs = plan.program(self.pipe_rank).instrs
        self.groups, self.device, self.timeout = groups, device, timeout
        self.hidden_size, self.dtype, self.wire = hidden_size, dtype, wire
        # the global rank of each pipeline rank of this replica (a message's peer), once
        # (at this rank's tensor coordinate: each tensor rank talks to its counterparts)
        self.tensor_rank = self.mesh.tensor_rank(rank)
        self.peers = tuple(self.mesh.rank(pipe=p, data=self.data_rank, tensor=self.tensor_rank)
                           for p in range(self.mesh.pipe))
        self.posted: dict[int, tuple[object, torch.Tensor]] = {}
        self.ahead = RecvAhead(self.instrs, self._recv_bytes, self.LOOKAHEAD_COMPUTES, self.LOOKAHEAD_BYTES)
        self.sends: list[tuple[object, torch.Tensor, str]] = []
        # gloo: its point-to-point works say they are completed only once waited on, so a send
        # kept for `flush` would hold its tensor the whole step; a thread waits on them instead
        self.reaper = SendReaper(timeout) if self.buffered else None
        self.channels = channels if channels is not None else Channels()
        # the current exchange: its members' positions, and its sends until it is issued
        self.exchange_span: range = range(0)
        self.exchange_sends: list[tuple[object, torch.Tensor, str]] = []
        # what this rank waits for and since when (read by the watchdog thread); set only
        # through `waiting`
        self.blocked_on: tuple[str, float] | None = None
        # NCCL: the work handles waited on without blocking the host, with what they are and
        # since when, until they complete (read by the watchdog thread)
        self.in_flight: deque[tuple[object, str, float]] = deque()
        self.flat: dict[int, torch.Tensor] = {}  # stage -> its gradients' flat buffer (data > 1)
        self.batched: set[int] = set()  # positions of receives posted by an exchange
        self.deferred: dict[Message, tuple[object, str]] = {}  # NCCL: receives waited at their use

    @property
    def buffered(self) -> bool:
        """gloo's buffered rules: tagged isend/irecv, receives posted ahead (`RecvAhead`);
        otherwise batches of one, matched by order, each receive at its own instruction."""
        return self.wire is Wire.BUFFERED

    @property
    def nccl(self) -> bool:
        return self.wire is Wire.NCCL

    @property
    def rendezvous(self) -> bool:
        return self.wire is Wire.RENDEZVOUS

    def _global(self, pipe_rank: int) -> int:
        return self.peers[pipe_rank]

    def _line(self, index: int) -> str:
        """' (plan.tpir line 12: send act stage 0 mb 1 slice 0 to 1)', or '' out of range."""
        if not 0 <= index < len(self.instrs):
            return ""
        ins = self.instrs[index]
        at = f"{ins.loc.file or self.plan.source or 'the plan'} line {ins.loc.line}" if ins.loc else f"instruction {index}"
        return f" ({at}: {ins})"

    @contextmanager
    def waiting(self, what: str):
        """Mark a wait on the other ranks (a receive, a collective, a checkpoint), so that the
        watchdog can say what this rank was waiting for if it never ends."""
        self.blocked_on = (what, time.monotonic())
        try:
            yield
        finally:
            self.blocked_on = None

    def start_step(self, step: int) -> None:
        self.posted.clear()
        self.ahead.reset()

    # ---------------------------------------------------------------------- receives

    def before_instruction(self, index: int) -> None:
        """About to run instruction `index`: post the receives `semantics.RecvAhead` says, in
        program order (so each channel's receives are posted in order).

        Only on gloo. NCCL runs the sends and receives between two ranks in issue order on one
        stream and a send completes only when received, so a receive posted early would hold
        back this rank's later sends to that peer, which the peer may need first (1F1B: the
        activation one way while the gradient comes back). On NCCL each receive is issued
        at its own instruction, where the plan's order (verified deadlock-free) applies."""
        if not self.buffered:
            return
        for j in self.ahead.before(index):
            self._post(j)

    def _recv_shape(self, index: int) -> tuple[int, int, int]:
        ins = self.instrs[index]
        return message_shape(self.header, ins.mb, ins.slice, self.hidden_size)

    def _recv_bytes(self, index: int) -> int:
        b, l, h = self._recv_shape(index)
        return b * l * h * self.dtype.itemsize

    def _post(self, index: int) -> None:
        ins = self.instrs[index]
        buf = torch.empty(self._recv_shape(index), dtype=self.dtype, device=self.device)
        src = self._global(ins.peer)
        tag = self.channels.next_received(src)
        work = self._p2p(dist.irecv, buf, src, tag)
        self.posted[index] = (work, buf)

    def _p2p(self, op, tensor: torch.Tensor, peer: int, tag: int):
        """One send or receive. Under gloo's rules a tagged `isend`/`irecv`. Under NCCL's, a
        `batch_isend_irecv` of one: PyTorch's NCCL process group runs batched operations on the
        group's communicator (made by the barrier before the first step) but gives unbatched
        ones a communicator of their own per pair of ranks, created lazily, so mixing them with
        the exchanges (always batched) would put one pair's messages on two communicators and
        two streams, out of the issue order that the plan was verified under
        (tpc.ir.semantics), and each lazy creation blocks the host until the peer creates it
        too. Batches only, every send and receive of a rank runs in issue order on one stream,
        as the rules say."""
        try:
            if self.buffered:
                return op(tensor, peer, tag=tag)
            return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)])[0]
        except Exception as e:  # noqa: BLE001 - a dead peer surfaces as whatever the backend raises
            verb = "the send to" if op is dist.isend else "the receive from"
            raise gave_up(f"{verb} rank {peer} to be posted", e) from None

    def recv(self, key: Message, src: int, shape, dtype, index: int) -> torch.Tensor:
        if index in self.exchange_span and index not in self.posted:
            self._issue_exchange()
        if index not in self.posted:
            self.ahead.post(index)
            self._post(index)
        work, buf = self.posted.pop(index)
        self.ahead.taken(index)
        what = f"the message {key} from rank {self._global(src)}"
        if self.nccl and index in self.batched:
            # an exchange's receive (lowering moved it up to its send): the stream waits for
            # it only where its value is used (`claim`), so the computes between still overlap
            self.batched.discard(index)
            self.deferred[key] = (work, what)
            return buf
        self.wait(work, what)
        return buf

    def claim(self, key: Message) -> None:
        """The engine is about to use the received value `key`: wait for it if its wait was
        deferred (an exchange's receive on NCCL)."""
        got = self.deferred.pop(key, None)
        if got is not None:
            self.wait(*got)

    # ------------------------------------------------------------------------- sends

    def send(self, key: Message, tensor: torch.Tensor, dst: int, index: int) -> None:
        dst_g = self._global(dst)
        # said with its plan line: a failed send is found only later (`flush`, at the step)
        what = f"the send of {key} to rank {dst_g}{self._line(index)}"
        if index in self.exchange_span:
            self.exchange_sends.append((dist.P2POp(dist.isend, tensor, dst_g), tensor, what))
            if index == self.exchange_span[-1]:  # an exchange of sends only
                self._issue_exchange()
            return
        tag = self.channels.next_sent(dst_g)
        work = self._p2p(dist.isend, tensor, dst_g, tag)
        if self.rendezvous:  # NCCL's rules on gloo: the send completes before the rank goes on
            self.wait(work, what)
            return
        if self.reaper is not None:  # freed as soon as it completes (`SendReaper`)
            self.reaper.add(work, tensor, what)
            return
        # drop the finished sends, so that their buffers (a slice's activation, which the
        # runtime no longer holds once sent) are freed during the step
        self.sends = [s for s in self.sends if not s[0].is_completed()]
        self.sends.append((work, tensor, what))

    # --------------------------------------------------------------------- exchanges

    def exchange(self, index: int, count: int) -> None:
        """The next `count` instructions (sends, then receives) are one batch. With gloo's
        buffered rules a batch changes nothing (sends never block there), so it is issued as
        separate operations."""
        if self.buffered:
            return
        self.exchange_span = range(index + 1, min(index + 1 + count, len(self.instrs)))
        self.exchange_sends = []

    def _issue_exchange(self) -> None:
        """Issue the current exchange as one `batch_isend_irecv` (NCCL: one group, the sends
        and receives complete together): its sends, already collected, and its receives, into
        buffers of the plan's shapes. Each receive is waited on at its own instruction."""
        recvs = [q for q in self.exchange_span if self.instrs[q].op is Op.RECV]
        ops = [op for op, _, _ in self.exchange_sends]
        bufs = []
        for q in recvs:
            ins = self.instrs[q]
            buf = torch.empty(self._recv_shape(q), dtype=self.dtype, device=self.device)
            bufs.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, self._global(ins.peer)))
        works = dist.batch_isend_irecv(ops)
        n = len(self.exchange_sends)
        for (_, tensor, what), work in zip(self.exchange_sends, works[:n]):
            if self.rendezvous:
                self.wait(work, what)
            else:
                self.sends.append((work, tensor, what))
        for q, buf, work in zip(recvs, bufs, works[n:]):
            self.posted[q] = (work, buf)
            self.batched.add(q)
        self.exchange_span, self.exchange_sends = range(0), []

    def flush(self) -> None:
        """Wait for every send of this rank (before `step` and at the end of the stream)."""
        for key in list(self.deferred):
            self.claim(key)
        if self.reaper is not None:
            with self.waiting("the sends of this rank"):
                failed = self.reaper.drain()
            if failed is not None:
                raise gave_up(*failed)
        sends, self.sends = self.sends, []
        for work, _tensor, what in sends:
            self.wait(work, what)

    # ------------------------------------------------------------------------ collectives

    def allreduce(self, stage: int, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Sum a stage's gradients over the data-parallel group as one flat buffer, kept from
        step to step: the first time, the gradients are copied in and views of the buffer are
        returned to become the gradients; from then on backward accumulates into the buffer and
        it is reduced in place, with no copy."""
        if self.groups.dp is None or not tensors:
            return None
        flat = self.flat.get(stage)
        if flat is None or not views_of(flat, tensors):
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self.flat[stage] = flat
            views, offset = [], 0
            for t in tensors:
                views.append(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
        else:
            views = None  # already the gradients
        self.collective(f"the gradients of stage {stage} from the other data-parallel replicas", dist.all_reduce,
                        flat, group=self.groups.dp)
        return views

    # the sharded optimizer's collectives (training/sharded_optimizer.py), in place on one flat
    # buffer of d equal chunks: NCCL's reduce-scatter and all-gather (gloo has them too since
    # torch 2.x; where a gloo build lacks the reduce-scatter it is an allreduce of the whole
    # buffer, twice the bytes, the same sums)
    reduce_scatter_supported = True

    def reduce_scatter(self, stage: int, flat: torch.Tensor) -> None:
        if self.groups.dp is None:
            return
        mine = flat.chunk(self.mesh.data)[self.data_rank]
        what = f"the gradients of stage {stage} from the other data-parallel replicas"
        if self.reduce_scatter_supported:
            op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            try:
                work = op(mine, flat, group=self.groups.dp, async_op=True)
            except (RuntimeError, NotImplementedError) as e:
                if "support" not in str(e).lower():
                    raise gave_up(what, e) from None
                DistTransport.reduce_scatter_supported = False  # this backend lacks it: allreduce
            else:
                self.wait(work, what)
                return
        self.collective(what, dist.all_reduce, flat, group=self.groups.dp)

    def all_gather(self, stage: int, flat: torch.Tensor) -> None:
        if self.groups.dp is None:
            return
        mine = flat.chunk(self.mesh.data)[self.data_rank]
        op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.collective(f"the weights of stage {stage} from the other data-parallel replicas", op, flat, mine,
                        group=self.groups.dp)

    def sum_over_data(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.groups.dp is None:
            return tensor
        self.collective("the gradient norms of the other data-parallel replicas", dist.all_reduce, tensor,
                        group=self.groups.dp)
        return tensor

    def reduce_loss(self, tensor: torch.Tensor) -> None:
        if self.groups.dp is None:
            return
        self.collective("the evaluation loss of the other data-parallel replicas", dist.all_reduce, tensor,
                        group=self.groups.dp)

    def reduce_tied(self, name: str, tensor: torch.Tensor) -> None:
        group = self.groups.ties.get(name)
        if group is None:
            return
        self.collective(f"the gradient of tie {name!r} from the other ranks holding it", dist.all_reduce, tensor,
                        group=group)

    def reduce_replicas(self, stage: int, tensors: list[torch.Tensor]) -> None:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.collective(f"the gradients of stage {stage} from the ranks of its other replicas", dist.all_reduce,
                        flat, group=self.groups.replicas[stage])
        offset = 0
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()

    def sum_over_pipeline(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.groups.pipeline is None:
            return tensor
        t = tensor.to(self.device)
        self.collective("the gradient norms of the other pipeline ranks", dist.all_reduce, t, group=self.groups.pipeline)
        return t  # on the device: the step reads it once, with its loss

    # ---------------------------------------------------------------------------- waits

    def collective(self, what: str, op, *args, **kwargs) -> None:
        """Post the collective `op(*args, **kwargs)` and wait for it (`what` it waits for: for
        the error and the watchdog). A peer that died fails the posting or the wait; either is
        said as that (`gave_up`), never as the backend's raw text."""
        try:
            work = op(*args, **kwargs, async_op=True)
        except Exception as e:  # noqa: BLE001 - a failed peer surfaces as whatever the backend raises
            raise gave_up(what, e) from None
        self.wait(work, what)

    def wait(self, work, what: str) -> None:
        """Wait for `work` (what it is: for the error and the watchdog)."""
        if self.nccl:
            # WorkNCCL.wait() makes this rank's current CUDA stream wait for the work and
            # returns at once; with a timeout it would block the host until the work is done,
            # so no communication would overlap compute. The watchdog reads is_completed().
            work.wait()
            self.in_flight.append((work, what, time.monotonic()))
            if len(self.in_flight) > 64:
                self.prune()
            return
        with self.waiting(what):
            try:
                work.wait(timeout=timedelta(seconds=self.timeout))
            except Exception as e:  # noqa: BLE001 - a failed peer surfaces as whatever the backend raises
                raise gave_up(what, e) from None


    def prune(self) -> None:
        """Forget the NCCL works that have completed."""
        while self.in_flight and self.in_flight[0][0].is_completed():
            self.in_flight.popleft()

    def overdue(self, limit: float) -> str | None:
        """What this rank has waited on for longer than `limit` seconds, or None: a wait that
        blocks the host, or (NCCL) the oldest work not completed."""
        now = time.monotonic()
        waiting = self.blocked_on
        if waiting is not None and now - waiting[1] > limit:
            return waiting[0]
        for work, what, since in list(self.in_flight):
            if now - since <= limit:
                break
            if not work.is_completed():
                return what
        return None


def views_of(flat: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    """Whether `tensors` are, in order, the consecutive views of `flat` that `allreduce` made."""
    base, offset = flat.untyped_storage().data_ptr(), 0
    for t in tensors:
        if (t.untyped_storage().data_ptr() != base or t.storage_offset() != offset
                or not t.is_contiguous()):
            return False
        offset += t.numel()
    return offset == flat.numel()
