"""The distributed executor: one process per rank under torchrun (gloo on CPU, NCCL on CUDA).

Every process reads the plan and the model file itself and refuses to start, before any
communication, when the world does not match the plan's mesh or the model file is not the one
the plan was compiled from (all ranks see the same files, so all refuse alike).

Communication follows the plan's semantics with torch.distributed, under the rules of the
backend (tpc.ir.semantics; the plan is verified under them before the run):

- point-to-point, gloo's buffered rules (the default on the CPU): receives are posted early
  (`irecv` into a buffer of the shape the plan implies, for every `recv` up to the compute after
  the next one) and waited on just before the instruction that needs them; sends are `isend`s
  whose work handles a thread waits on, letting go of each tensor as its send completes
  (`_SendReaper`), and the rank waits for them all before `step`; the n-th message of a
  channel carries tag n, so a mismatch could never be matched silently. An `exchange` changes
  nothing there;
- point-to-point, NCCL's rules (on CUDA; on the CPU with `--comm nccl`): each receive is issued
  at its own instruction (see `DistTransport.before_instruction`), matched by order, and each
  `exchange N` is one `batch_isend_irecv` of its sends and receives, issued at its first
  receive (its sends are collected until then). On NCCL no wait blocks the host: `wait()`
  orders the CUDA stream, and the watchdog reads `is_completed()`. On gloo with `--comm nccl`
  every send and exchange is waited on before the next instruction, the rendezvous NCCL's rules
  describe, so the CPU tests run the path and the rules a GPU run takes;
- `allreduce stage S`: one flat buffer per stage (not one call per parameter), kept from step
  to step with the stage's gradients living in it, summed in place over the data-parallel group
  of this pipeline rank;
- `reduce-tied NAME`: the tied gradient summed over the ranks of this replica that hold the tie.

Process groups: one data-parallel group per pipeline rank, one tie group per (tie, replica),
created on every rank in the same order (torch requires it).

Faults: a rank whose instruction fails prints its located error and leaves with status 1 at
once (os._exit: no teardown that could wait for peers). A rank waiting for a peer gives up after
--timeout seconds, or as soon as gloo reports the peer's connection closed, and says which rank,
step and instruction it was blocked on; a watchdog thread backs this up for any wait that does
not honour the timeout, and on NCCL (whose waits do not block the host) watches every work
handle until it completes. So no run hangs.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tpc.executors.engine import DTYPES, RankEngine, stage_factory_from_model
from tpc.executors.options import RunOptions
from tpc.executors.plan_model import check_plan_model, load_plan_model, slice_model
from tpc.executors.rank_layout import describe as describe_layout
from tpc.executors.evaluation import eval_batches
from tpc.executors.run import GradientCheck, Reporter, batch_source, check_bf16, write_trace
from tpc.executors.training.run_checkpoints import RunCheckpoints
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Op, Plan
from tpc.ir.verify import verify_file
from tpc.ir.semantics import GLOO, NCCL, Message, RecvAhead


# ------------------------------------------------------------------------- before anything


@dataclass(frozen=True)
class World:
    """This process's place: `rank` and `size` are global (all nodes), `local_rank` and
    `local_size` count the processes of this node (the GPU is cuda:local_rank), `node` is the
    node's index (torchrun's GROUP_RANK)."""

    rank: int
    size: int
    local_rank: int
    local_size: int = 0  # 0: unknown (taken as `size`: one node)
    node: int = 0

    @property
    def nodes(self) -> int:
        """How many nodes the world spans (all with `local_size` processes, as torchrun starts them)."""
        return max(1, self.size // (self.local_size or self.size))

    @staticmethod
    def from_env() -> "World":
        """The process's place as torchrun describes it: RANK, WORLD_SIZE (global), LOCAL_RANK,
        LOCAL_WORLD_SIZE, GROUP_RANK (this node). Started by hand without the local ones, a
        process is taken to be on one node with all the others."""
        env = os.environ
        try:
            rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
            local_size = int(env.get("LOCAL_WORLD_SIZE", size))
            local_rank = int(env.get("LOCAL_RANK", rank % local_size))
            node = int(env.get("GROUP_RANK", rank // local_size))
        except (KeyError, ValueError, ZeroDivisionError) as e:
            raise TpirError(Diagnostic(
                f"`tpc run` without --interpret runs one rank per process under torchrun, but the "
                f"torchrun environment is missing or malformed ({e})",
                hint="start with `torchrun --nproc-per-node N --no-python tpc run PLAN` (on several "
                     "machines: `torchrun --nnodes K --nproc-per-node N --rdzv-backend c10d "
                     "--rdzv-endpoint HOST:PORT ...` on each, docs/training.md), or run "
                     "`tpc run --interpret PLAN` in one process")) from None
        return World(rank, size, local_rank, local_size, node)


def check_world(plan: Plan, world: World) -> None:
    """Refuse a world that does not match the plan's mesh."""
    mesh = plan.header.mesh
    need = mesh.pipe * mesh.data
    if world.size != need:
        nodes = world.nodes
        started = f"{world.size}" if nodes == 1 else f"{world.size} ({nodes} nodes x {world.local_size})"
        launch = (f"`torchrun --nproc-per-node {need} ...`" if nodes == 1 or need % nodes else
                  f"`torchrun --nnodes {nodes} --nproc-per-node {need // nodes} ...` on each node")
        raise TpirError(Diagnostic(
            f"the plan needs {need} processes (mesh pipe {mesh.pipe} data {mesh.data}), but "
            f"torchrun started {started}",
            loc=plan.header.mesh.loc, where=plan.source,
            hint=f"run {launch}, or compile a plan for {world.size} ranks"))


# ------------------------------------------------------------------------------ the groups


@dataclass
class Groups:
    """This rank's process groups (None where a group would have one member)."""

    dp: object | None
    ties: dict[str, object | None] = field(default_factory=dict)
    # stage -> the group of the ranks holding its weight replicas (this data replica's)
    replicas: dict[int, object | None] = field(default_factory=dict)
    pipeline: object | None = None  # this replica's pipeline ranks (the global gradient norm)


def make_groups(plan: Plan, world: World, timeout: float, *, pipeline: bool = False) -> Groups:
    """Every group, created by every rank in the same order; this rank keeps its own. The
    pipeline groups (one per replica) only when asked for (gradient clipping)."""
    h = plan.header
    pipe, data = h.mesh.pipe, h.mesh.data
    me_p, me_d = world.rank % pipe, world.rank // pipe
    groups = Groups(dp=None)
    t = timedelta(seconds=timeout)
    if data > 1:
        for p in range(pipe):
            g = dist.new_group([d * pipe + p for d in range(data)], timeout=t)
            if p == me_p:
                groups.dp = g
    for tie in h.ties:
        ranks = sorted({h.stage_ranks(s)[0] for s in tie.stages})
        for d in range(data):
            members = [d * pipe + r for r in ranks]
            g = dist.new_group(members, timeout=t) if len(members) > 1 else None
            if d == me_d and me_p in ranks:
                groups.ties[tie.name] = g
    for st in h.stages:
        if not st.replicas:
            continue
        for d in range(data):
            g = dist.new_group([d * pipe + r for r in sorted(st.ranks)], timeout=t)
            if d == me_d and me_p in st.ranks:
                groups.replicas[st.index] = g
    if pipeline and pipe > 1:
        for d in range(data):
            g = dist.new_group([d * pipe + p for p in range(pipe)], timeout=t)
            if d == me_d:
                groups.pipeline = g
    return groups


# --------------------------------------------------------------------------- the transport


def _gave_up(what: str, e: BaseException) -> TpirError:
    """The error of a wait on a peer that failed: what was waited for, and the backend's cause."""
    return TpirError(Diagnostic(f"gave up waiting for {what}: {backend_cause(e)}",
                                hint="that rank failed or is stuck: see its own error above; if it is "
                                     "merely slow, raise --timeout"))


class _SendReaper:
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

    def __init__(self, plan: Plan, world: World, groups: Groups, *, device: torch.device,
                 hidden_size: int, dtype: torch.dtype, timeout: float, tags: bool,
                 nccl: bool = False, rendezvous: bool = False):
        """`tags`: gloo with its buffered sends (receives posted ahead, the n-th message of a
        channel tagged n); else the NCCL branch (receives at their own instruction, matched by
        order). `nccl`: the backend is NCCL, whose `wait(timeout=...)` would block the host:
        waits only order the device's stream, and the watchdog reads `is_completed()`.
        `rendezvous`: on gloo, run NCCL's rules (tpc.ir.semantics): each send, and each
        exchange, is waited on before the next instruction, so a plan that would hang on
        NCCL hangs here too (and is reported)."""
        self.plan, self.header = plan, plan.header
        self.pipe = plan.header.mesh.pipe
        self.pipe_rank, self.data_rank = world.rank % self.pipe, world.rank // self.pipe
        self.instrs = plan.program(self.pipe_rank).instrs
        self.groups, self.device, self.timeout = groups, device, timeout
        self.hidden_size, self.dtype, self.tags = hidden_size, dtype, tags
        self.nccl, self.rendezvous = nccl, rendezvous
        self.early = tags  # post receives ahead: gloo's buffered rules only, see `ahead`
        self.posted: dict[int, tuple[object, torch.Tensor]] = {}
        self.ahead = RecvAhead(self.instrs, self._recv_bytes, self.LOOKAHEAD_COMPUTES, self.LOOKAHEAD_BYTES)
        self.sends: list[tuple[object, torch.Tensor, str]] = []
        # gloo: its point-to-point works say they are completed only once waited on, so a send
        # kept for `flush` would hold its tensor the whole step; a thread waits on them instead
        self.reaper = _SendReaper(timeout) if tags and not rendezvous else None
        self.sent: dict[int, int] = {}  # messages sent per destination (the tag of the next)
        self.received: dict[int, int] = {}  # receives posted per source
        # the current exchange: its members' positions, and its sends until it is issued
        self.exchange_span: range = range(0)
        self.exchange_sends: list[tuple[object, torch.Tensor, str]] = []
        # what this rank waits for and since when (read by the watchdog thread); set only
        # through `waiting_for`
        self.waiting: tuple[str, float] | None = None
        # NCCL: the work handles waited on without blocking the host, with what they are and
        # since when, until they complete (read by the watchdog thread)
        self.in_flight: deque[tuple[object, str, float]] = deque()
        self.flat: dict[int, torch.Tensor] = {}  # stage -> its gradients' flat buffer (data > 1)
        self.batched: set[int] = set()  # positions of receives posted by an exchange
        self.deferred: dict[Message, tuple[object, str]] = {}  # NCCL: receives waited at their use

    def _global(self, pipe_rank: int) -> int:
        return self.data_rank * self.pipe + pipe_rank

    @contextmanager
    def waiting_for(self, what: str):
        """Mark a wait on the other ranks (a receive, a collective, a checkpoint), so that the
        watchdog can say what this rank was waiting for if it never ends."""
        self.waiting = (what, time.monotonic())
        try:
            yield
        finally:
            self.waiting = None

    def start_step(self) -> None:
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
        if not self.early:
            return
        for j in self.ahead.before(index):
            self._post(j)

    def _recv_shape(self, index: int) -> tuple[int, int, int]:
        ins = self.instrs[index]
        lo, hi = self.header.microbatches[ins.mb].slices[ins.slice]
        return self.header.microbatches[ins.mb].size, hi - lo, self.hidden_size

    def _recv_bytes(self, index: int) -> int:
        b, l, h = self._recv_shape(index)
        return b * l * h * self.dtype.itemsize

    def _post(self, index: int) -> None:
        ins = self.instrs[index]
        buf = torch.empty(self._recv_shape(index), dtype=self.dtype, device=self.device)
        src = self._global(ins.peer)
        tag = self.received.get(src, 0)
        self.received[src] = tag + 1
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
        if self.tags:
            return op(tensor, peer, tag=tag)
        return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)])[0]

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
        self._wait(work, what)
        return buf

    def claim(self, key: Message) -> None:
        """The engine is about to use the received value `key`: wait for it if its wait was
        deferred (an exchange's receive on NCCL)."""
        got = self.deferred.pop(key, None)
        if got is not None:
            self._wait(*got)

    # ------------------------------------------------------------------------- sends

    def send(self, key: Message, tensor: torch.Tensor, dst: int, index: int) -> None:
        dst_g = self._global(dst)
        what = f"the send of {key} to rank {dst_g}"
        if index in self.exchange_span:
            self.exchange_sends.append((dist.P2POp(dist.isend, tensor, dst_g), tensor, what))
            if index == self.exchange_span[-1]:  # an exchange of sends only
                self._issue_exchange()
            return
        tag = self.sent.get(dst_g, 0)
        self.sent[dst_g] = tag + 1
        work = self._p2p(dist.isend, tensor, dst_g, tag)
        if self.rendezvous:  # NCCL's rules on gloo: the send completes before the rank goes on
            self._wait(work, what)
            return
        if self.reaper is not None:  # freed as soon as it completes (`_SendReaper`)
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
        if self.tags:
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
                self._wait(work, what)
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
            with self.waiting_for("the sends of this rank"):
                failed = self.reaper.drain()
            if failed is not None:
                raise _gave_up(*failed)
        sends, self.sends = self.sends, []
        for work, _tensor, what in sends:
            self._wait(work, what)

    # ------------------------------------------------------------------------ collectives

    def allreduce(self, stage: int, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Sum a stage's gradients over the data-parallel group as one flat buffer, kept from
        step to step: the first time, the gradients are copied in and views of the buffer are
        returned to become the gradients; from then on backward accumulates into the buffer and
        it is reduced in place, with no copy."""
        if self.groups.dp is None or not tensors:
            return None
        flat = self.flat.get(stage)
        if flat is None or not _views_of(flat, tensors):
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self.flat[stage] = flat
            views, offset = [], 0
            for t in tensors:
                views.append(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
        else:
            views = None  # already the gradients
        work = dist.all_reduce(flat, group=self.groups.dp, async_op=True)
        self._wait(work, f"the gradients of stage {stage} from the other data-parallel replicas")
        return views

    def reduce_loss(self, tensor: torch.Tensor) -> None:
        if self.groups.dp is None:
            return
        work = dist.all_reduce(tensor, group=self.groups.dp, async_op=True)
        self._wait(work, "the evaluation loss of the other data-parallel replicas")

    def reduce_tied(self, name: str, tensor: torch.Tensor) -> None:
        group = self.groups.ties.get(name)
        if group is None:
            return
        work = dist.all_reduce(tensor, group=group, async_op=True)
        self._wait(work, f"the gradient of tie {name!r} from the other ranks holding it")

    def reduce_replicas(self, stage: int, tensors: list[torch.Tensor]) -> None:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        work = dist.all_reduce(flat, group=self.groups.replicas[stage], async_op=True)
        self._wait(work, f"the gradients of stage {stage} from the ranks of its other replicas")
        offset = 0
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()

    def sum_over_pipeline(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.groups.pipeline is None:
            return tensor
        t = tensor.to(self.device)
        work = dist.all_reduce(t, group=self.groups.pipeline, async_op=True)
        self._wait(work, "the gradient norms of the other pipeline ranks")
        return t.cpu()

    # ---------------------------------------------------------------------------- waits

    def _wait(self, work, what: str) -> None:
        if self.nccl:
            # WorkNCCL.wait() makes this rank's current CUDA stream wait for the work and
            # returns at once; with a timeout it would block the host until the work is done,
            # so no communication would overlap compute. The watchdog reads is_completed().
            work.wait()
            self.in_flight.append((work, what, time.monotonic()))
            if len(self.in_flight) > 64:
                self.prune()
            return
        with self.waiting_for(what):
            try:
                work.wait(timeout=timedelta(seconds=self.timeout))
            except Exception as e:  # noqa: BLE001 - a failed peer surfaces as whatever the backend raises
                raise _gave_up(what, e) from None


    def prune(self) -> None:
        """Forget the NCCL works that have completed."""
        while self.in_flight and self.in_flight[0][0].is_completed():
            self.in_flight.popleft()

    def overdue(self, limit: float) -> str | None:
        """What this rank has waited on for longer than `limit` seconds, or None: a wait that
        blocks the host, or (NCCL) the oldest work not completed."""
        now = time.monotonic()
        waiting = self.waiting
        if waiting is not None and now - waiting[1] > limit:
            return waiting[0]
        for work, what, since in list(self.in_flight):
            if now - since <= limit:
                break
            if not work.is_completed():
                return what
        return None


def _views_of(flat: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    """Whether `tensors` are, in order, the consecutive views of `flat` that `allreduce` made."""
    base, offset = flat.untyped_storage().data_ptr(), 0
    for t in tensors:
        if (t.untyped_storage().data_ptr() != base or t.storage_offset() != offset
                or not t.is_contiguous()):
            return False
        offset += t.numel()
    return offset == flat.numel()


def backend_cause(e: Exception) -> str:
    """The useful words of a backend error: gloo's "[.../pair.cc:537] Read error [addr]:port:
    Connection reset by peer. This is typically caused by..." becomes "Connection reset by peer"."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # the source position of the backend
    text = text.split(". This is typically")[0]
    if text.startswith("Read error") or text.startswith("Write error"):
        text = text.split(": ", 1)[-1] if ": " in text else text
    return text


# ------------------------------------------------------------------------------ the watchdog


class Watchdog(threading.Thread):
    """Ends the process when its rank has waited on one message or collective far longer than
    --timeout: the backstop for a wait the backend does not time out itself."""

    def __init__(self, engine: RankEngine, transport: DistTransport, timeout: float):
        super().__init__(daemon=True, name="tpc-watchdog")
        self.engine, self.transport = engine, transport
        self.limit = timeout * 1.5 + 5.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(min(1.0, self.limit / 10)):
            what = self.transport.overdue(self.limit)
            if what is not None:
                e = self.engine
                where = e.where(e.pc) if not e.done else f"rank {e.rank_name}, end of the stream"
                fail(f"{where} (step {e.step}): no progress for {self.limit:.0f} s waiting for {what}",
                     hint="a peer failed or is stuck: see its own error; if it is merely slow, raise --timeout")


def fail(message: str | TpirError, hint: str = "") -> None:
    """Print the error and leave at once with status 1 (no teardown that might wait on peers)."""
    text = message.render() if isinstance(message, TpirError) else TpirError(Diagnostic(message, hint=hint)).render()
    try:
        sys.stdout.flush()
        print(text, file=sys.stderr, flush=True)
    finally:
        os._exit(1)


# --------------------------------------------------------------------------------- running


@dataclass
class RankOutcome:
    """What one rank's run produced: losses per step (the global loss, the same on every rank),
    the gradients of the first step before its update (this rank's parameters, by name), the
    rank's parameters after the last step, and its trace events."""

    losses: list[float]
    first_grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    peak_live: int
    events: list
    # (completed steps, validation loss) of each evaluation, the same on every rank
    eval_losses: list = field(default_factory=list)


def make_transport(plan: Plan, world: World, groups: Groups, *, device: torch.device, hidden_size: int,
                   dtype: torch.dtype, options: RunOptions) -> DistTransport:
    """The transport of a plan (training, evaluation, each plan of a bundle) for the backend this
    process runs and the rules the run is under (`--comm`, default the backend's own): gloo's
    buffered rules with tags; NCCL itself; or NCCL's rules emulated on gloo (rendezvous)."""
    backend, rules = dist.get_backend(), options.comm_rules(device)
    return DistTransport(plan, world, groups, device=device, hidden_size=hidden_size, dtype=dtype,
                         timeout=options.timeout, tags=backend == "gloo" and rules == GLOO,
                         nccl=backend == "nccl", rendezvous=backend != "nccl" and rules == NCCL)


def init(world: World, device: torch.device, timeout: float) -> None:
    """Join the process group (gloo on CPU, NCCL on CUDA)."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=world.rank,
                            world_size=world.size, timeout=timedelta(seconds=timeout))


def run_plan(plan: Plan, world: World, options: RunOptions, *, model: torch.nn.Module, device: torch.device,
             sliced=None, stage_factory=None, hidden_size: int | None = None, batches,
             on_step=None, checkpoints=None, before_instr=None, eval_batches=None,
             on_eval=None) -> RankOutcome:
    """Run this rank's stream up to step `options.steps` in an initialised process group: from
    step 0 (from --init-from weights, when `checkpoints` has them), or, when `checkpoints`
    (`tpc.executors.training.run_checkpoints.RunCheckpoints`) resumes, from the newest
    checkpoint's step. Every rank saves its own parameters when a checkpoint is due. A failure
    of this rank's instruction raises (located); the caller decides how to leave.
    `before_instr(engine, index)` runs before each instruction (fault injection)."""
    pipe = plan.header.mesh.pipe
    pipe_rank, data_rank = world.rank % pipe, world.rank // pipe
    if stage_factory is None:
        stage_factory = stage_factory_from_model(sliced, model)
        hidden_size = sliced.hidden_size
    groups = make_groups(plan, world, options.timeout, pipeline=options.needs_grad_norm)
    dtype = DTYPES[plan.header.shape.dtype]  # the plan was verified: a known name
    transport = make_transport(plan, world, groups, device=device, hidden_size=hidden_size, dtype=dtype,
                               options=options)
    engine = RankEngine(plan, pipe_rank, data_rank, transport, stage_factory, hidden_size=hidden_size,
                        options=options, device=device, before_instr=before_instr)
    evaluation = None
    if eval_batches is not None:
        evaluation = _evaluation(plan, world, options, eval_batches, groups, model, sliced, device,
                                 dtype, hidden_size)
    watchdog = Watchdog(engine, transport, options.timeout)
    watchdog.start()
    losses, first_grads, eval_losses = [], {}, []
    try:
        start = 0
        if checkpoints is not None:
            with transport.waiting_for("the other ranks to load the checkpoint"):
                start = checkpoints.start([engine])
        # a collective of every rank before any send or receive: NCCL wants the first use of a
        # group by batch_isend_irecv (an exchange) preceded by one involving all its ranks
        dist.barrier()
        engine.epoch = time.perf_counter()  # trace times count from a common start
        if evaluation is not None and start == 0:
            with transport.waiting_for("the evaluation before the first step"):
                eval_losses.append((0, evaluation.run()))
            if on_eval is not None:
                on_eval(0, eval_losses[-1][1])
        for step in range(start, options.steps):
            started = time.perf_counter()
            losses.append(_train_step(engine, transport, step, batches.get(step), device))
            if step == start:
                first_grads = dict(engine.grads)
            step_time = time.perf_counter() - started
            val = None
            if evaluation is not None and evaluation.due(step + 1):
                with transport.waiting_for("the evaluation"):
                    val = evaluation.run()
                eval_losses.append((step + 1, val))
            if on_step is not None:
                on_step(step, losses[-1], dict(lr=options.lr_at(step), grad_norm=engine.grad_norm,
                                               step_time=step_time, val_loss=val))
            if checkpoints is not None:
                with transport.waiting_for("the other ranks to write their checkpoint shards"):
                    checkpoints.after_step([engine], step + 1)
                    if val is not None:
                        checkpoints.after_eval([engine], step + 1, val)
    finally:
        watchdog.stop.set()
    return RankOutcome(losses, first_grads, {n: p.detach().cpu().clone() for n, p in engine.named_parameters},
                       engine.peak_live, engine.events, eval_losses)


def _evaluation(plan: Plan, world: World, options: RunOptions, batches, groups: Groups, model, sliced,
                device: torch.device, dtype: torch.dtype, hidden_size: int):
    """This rank's engine of the evaluation program, with a transport of its own over the same
    groups, its stages sharing the training stages' parameters; the loss is broadcast from the
    last stage's rank of replica 0 (after `reduce-loss` it holds the sum over the replicas)."""
    from tpc.executors.evaluation import Evaluation

    if sliced is None:
        raise TpirError(Diagnostic("evaluation needs the model's front end (`sliced`)",
                                   hint="run with the plan's model, not a stand-in stage factory"))
    view = plan.evaluation()
    pipe = view.header.mesh.pipe
    transport = make_transport(view, world, groups, device=device, hidden_size=hidden_size, dtype=dtype,
                               options=options)
    engine = RankEngine(view, world.rank % pipe, world.rank // pipe, transport,
                        stage_factory_from_model(sliced, model, evaluation=True), hidden_size=hidden_size,
                        options=options, device=device)
    # global rank: the evaluation's loss is on data replica 0 and weight replica 0
    src = view.header.stage_ranks(view.header.num_stages - 1)[0]

    def run_batch(k: int, tokens: torch.Tensor) -> float:
        transport.start_step()
        engine.run_step(k, tokens)
        loss = torch.tensor([engine.step_loss if world.rank == src else 0.0], dtype=torch.float64,
                            device=device)
        work = dist.broadcast(loss, src=src, async_op=True)
        transport._wait(work, f"the evaluation loss from rank {src}")
        return float(loss[0])

    return Evaluation(batches, options.eval_every, options.steps, run_batch, device)


def main(plan_path: str, options: RunOptions, world: World) -> int:
    """`tpc run` under torchrun: this process runs rank `world.rank` (World.from_env()). Returns
    the exit status (the same on every rank); a failure ends the process with status 1 (see
    `fail`)."""
    torch.set_num_threads(1)
    # every rank checks the same files: all refuse alike, before any communication; the plan
    # under the rules of the backend it will run on
    device = options.torch_device(world.local_rank)
    plan = verify_file(plan_path, options.comm_rules(device))
    check_world(plan, world)
    check_plan_model(plan)
    check_bf16(options, device)
    model = load_plan_model(plan, options.seed)
    sliced = slice_model(model, plan)
    gradient_check = GradientCheck(plan, options, model) if options.verify_grads else None
    model.to(device)
    batches = batch_source(plan, options)
    validation = eval_batches(plan, options)  # every rank refuses a bad file alike, before training
    try:
        init(world, device, options.timeout)
    except Exception as e:  # noqa: BLE001 - whatever the rendezvous raises, say what it means
        fail(f"rank {world.rank}: could not join the other {world.size - 1} rank(s) within "
             f"{options.timeout:g} s: {backend_cause(e)}",
             hint="every rank must start (torchrun --nproc-per-node N, and --nnodes K on each of K "
                  "machines) and reach MASTER_ADDR:MASTER_PORT")
    show = Reporter(options, plan, world.rank)
    report_layout(plan, world, show.message)
    checkpoints = RunCheckpoints.from_options(plan, options, say=show.message, model=model)
    try:
        outcome = run_plan(plan, world, options, model=model, device=device, sliced=sliced,
                           batches=batches, on_step=show, checkpoints=checkpoints,
                           eval_batches=validation, on_eval=show.evaluation)
        show.close()
    except TpirError as e:
        fail(e)
    except Exception as e:  # noqa: BLE001 - outside an instruction (setup): still report and leave
        fail(f"rank {world.rank}: {type(e).__name__}: {e}")
    status = 0
    if options.trace_path:
        gathered = [None] * world.size if world.rank == 0 else None
        dist.gather_object(outcome.events, gathered, dst=0)
        if world.rank == 0:
            write_trace(options.trace_path, [ev for evs in gathered for ev in evs])
    if gradient_check is not None:
        status = _check_gradients(world, outcome, gradient_check, batches)
    dist.barrier()
    dist.destroy_process_group()
    return status


def report_layout(plan: Plan, world: World, say) -> None:
    """On several nodes, rank 0 says which global ranks form each pipeline, on which nodes, and
    which pipeline links cross nodes (executors/rank_layout.py). Every rank takes part."""
    if world.nodes == 1:
        return
    node_of = [0] * world.size
    dist.all_gather_object(node_of, world.node)
    if world.rank == 0:
        for line in describe_layout(plan.header.mesh.pipe, plan.header.mesh.data, node_of):
            say(line)


def _check_gradients(world: World, outcome: RankOutcome, check, batches) -> int:
    """Every rank compares its own parameters' first-step gradients with plain autograd; the
    worst error over all ranks decides, the same on every rank; rank 0 prints it."""
    worst, name, held = check.compare_part(outcome.first_grads, batches.get(0))
    everyone = [None] * world.size
    dist.all_gather_object(everyone, (worst, name, sorted(held)))
    return check.conclude(outcome.losses[0], everyone, show=world.rank == 0)


# ------------------------------------------------------------------------- curricula


def run_bundle(plans: dict[int, Plan], length_of, world: World, options: RunOptions, *,
               model: torch.nn.Module, device: torch.device, batches, on_step=None,
               checkpoints=None, sliced: dict | None = None) -> RankOutcome:
    """`run_plan` for a plan bundle (executors/curriculum.py): step s runs the plan of length
    `length_of(s)`. One set of process groups (the plans share mesh and ties), one model and one
    optimizer serve every plan; each plan has its own engine and transport, which share the
    channels' message counts, so switching plans between steps needs no communication and no
    re-initialisation."""
    first = plans[min(plans)]
    pipe = first.header.mesh.pipe
    pipe_rank, data_rank = world.rank % pipe, world.rank // pipe
    groups = make_groups(first, world, options.timeout, pipeline=options.needs_grad_norm)
    dtype = DTYPES[first.header.shape.dtype]
    engines: dict[int, tuple[RankEngine, DistTransport]] = {}
    shared = None
    for seq, plan in sorted(plans.items()):
        traced = sliced[seq] if sliced is not None else slice_model(model, plan)
        transport = make_transport(plan, world, groups, device=device, hidden_size=traced.hidden_size,
                                   dtype=dtype, options=options)
        if shared is not None:  # the n-th message of a channel, whichever plan sends it
            transport.sent, transport.received = shared[1].sent, shared[1].received
        engine = RankEngine(plan, pipe_rank, data_rank, transport, stage_factory_from_model(traced, model),
                            hidden_size=traced.hidden_size, options=options, device=device,
                            optimizer=shared[0].optimizer if shared is not None else None)
        engines[seq] = (engine, transport)
        shared = shared or (engine, transport)
    engine, transport = shared
    watchdog = Watchdog(engine, transport, options.timeout)
    watchdog.start()
    losses, first_grads = [], {}
    try:
        start = 0
        if checkpoints is not None:
            with transport.waiting_for("the other ranks to load the checkpoint"):
                start = checkpoints.start([engine])
        dist.barrier()
        epoch = time.perf_counter()
        for e, _ in engines.values():
            e.epoch = epoch
        for step in range(start, options.steps):
            started = time.perf_counter()
            seq = length_of(step)
            engine, transport = engines[seq]
            watchdog.engine, watchdog.transport = engine, transport
            losses.append(_train_step(engine, transport, step, batches.get(step), device))
            if step == start:
                first_grads = dict(engine.grads)
            if on_step is not None:
                on_step(step, losses[-1], dict(lr=options.lr_at(step), grad_norm=engine.grad_norm,
                                               step_time=time.perf_counter() - started, seq=seq,
                                               tokens=plans[seq].header.tokens_per_step))
            if checkpoints is not None:
                with transport.waiting_for("the other ranks to write their checkpoint shards"):
                    checkpoints.after_step([engine], step + 1)
    finally:
        watchdog.stop.set()
    return RankOutcome(losses, first_grads, {n: p.detach().cpu().clone() for n, p in engine.named_parameters},
                       max(e.peak_live for e, _ in engines.values()),
                       [ev for e, _ in engines.values() for ev in e.events])


def main_curriculum(path: str, options: RunOptions, world: World, spec: str, data_type: str) -> int:
    """`tpc run PLANS --curriculum SPEC` under torchrun. Every rank reads and checks the bundle,
    the curriculum and the model file before any communication, so all refuse alike."""
    from tpc.executors.run import CurriculumRun

    torch.set_num_threads(1)
    run = CurriculumRun(path, options, spec, data_type)
    check_world(run.full, world)
    device = options.torch_device(world.local_rank)
    check_bf16(options, device)
    model = load_plan_model(run.full, options.seed)
    sliced = {seq: slice_model(model, plan) for seq, plan in run.plans.items()}
    model.to(device)
    batches = run.batches(options)
    try:
        init(world, device, options.timeout)
    except Exception as e:  # noqa: BLE001 - whatever the rendezvous raises, say what it means
        fail(f"rank {world.rank}: could not join the other {world.size - 1} rank(s) within "
             f"{options.timeout:g} s: {backend_cause(e)}",
             hint="every rank must start (torchrun --nproc-per-node N) and reach MASTER_ADDR:MASTER_PORT")
    show = Reporter(options, run.full, world.rank)
    show.message(run.describe())
    checkpoints = RunCheckpoints.from_options(run.full, options, say=show.message, model=model,
                                              curriculum=run.checkpoint_record())
    try:
        outcome = run_bundle(run.plans, run.length_of, world, options, model=model, device=device,
                             batches=batches, on_step=show, checkpoints=checkpoints, sliced=sliced)
        show.close()
    except TpirError as e:
        fail(e)
    except Exception as e:  # noqa: BLE001 - outside an instruction (setup): still report and leave
        fail(f"rank {world.rank}: {type(e).__name__}: {e}")
    if options.trace_path:
        gathered = [None] * world.size if world.rank == 0 else None
        dist.gather_object(outcome.events, gathered, dst=0)
        if world.rank == 0:
            write_trace(options.trace_path, [ev for evs in gathered for ev in evs])
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _train_step(engine, transport, step: int, tokens, device) -> float:
    """One training step of this rank's stream on `tokens`; the step's loss, summed over all
    ranks (a plan's run and a bundle's run take their steps alike)."""
    transport.start_step()
    engine.run_step(step, tokens)
    total = torch.tensor([engine.step_loss], dtype=torch.float64, device=device)
    with transport.waiting_for("the loss of the other ranks"):
        dist.all_reduce(total)
    return float(total)
