"""This process's place in a distributed run: the world torchrun describes, the process groups
the plan's mesh implies, and joining them.

`World` is what torchrun says of this process (global rank, world size, node). Which pipeline
rank of which replica a process runs, and who belongs to which group, is the mesh's to say
(tpc.ir.mesh): `make_groups` creates every group the plan needs from it, on every process in
the same order (torch.distributed requires it), and keeps this process's own.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tpc.executors.rank_layout import describe as describe_layout
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.mesh import DATA, PIPE, TENSOR
from tpc.ir.nodes import Plan


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
    need = mesh.value.size
    if world.size != need:
        nodes = world.nodes
        started = f"{world.size}" if nodes == 1 else f"{world.size} ({nodes} nodes x {world.local_size})"
        launch = (f"`torchrun --nproc-per-node {need} ...`" if nodes == 1 or need % nodes else
                  f"`torchrun --nnodes {nodes} --nproc-per-node {need // nodes} ...` on each node")
        raise TpirError(Diagnostic(
            f"the plan needs {need} processes (mesh {mesh.sizes}), but "
            f"torchrun started {started}",
            loc=plan.header.mesh.loc, where=plan.source,
            hint=f"run {launch}, or compile a plan for {world.size} ranks"))


@dataclass
class Groups:
    """This rank's process groups (None where a group would have one member)."""

    dp: object | None
    ties: dict[str, object | None] = field(default_factory=dict)
    # stage -> the group of the ranks holding its weight replicas (this data replica's)
    replicas: dict[int, object | None] = field(default_factory=dict)
    pipeline: object | None = None  # this replica's pipeline ranks (the global gradient norm)
    tensor: object | None = None  # the ranks sharing this rank's stages' weights (a tensor axis)


def make_groups(plan: Plan, world: World, timeout: float, *, pipeline: bool = False) -> Groups:
    """Every group of the plan's mesh, created by every rank in the same order; this rank keeps
    its own: its data-parallel group, each tie's ranks in its replica, each replicated stage's
    ranks in its replica, (only when asked: the global gradient norm) its pipeline, and with a
    tensor axis its tensor group."""
    h = plan.header
    mesh = h.mesh.value
    me = world.rank
    t = timedelta(seconds=timeout)
    groups = Groups(dp=None)

    def create(family: list[tuple[int, ...]]) -> object | None:
        """Create each group of `family` (a group of one is no group); this rank's, or None."""
        mine = None
        for members in family:
            g = dist.new_group(list(members), timeout=t) if len(members) > 1 else None
            if me in members:
                mine = g
        return mine

    if mesh.data > 1:
        groups.dp = create(mesh.groups(DATA))
    for tie in h.ties:
        family = mesh.subgroups(h.tie_ranks(tie.name))
        g = create(family)
        if any(me in members for members in family):
            groups.ties[tie.name] = g
    for st in h.stages:
        if st.replicas:
            family = mesh.subgroups(st.ranks)
            g = create(family)
            if any(me in members for members in family):
                groups.replicas[st.index] = g
    if pipeline and mesh.pipe > 1:
        groups.pipeline = create(mesh.groups(PIPE))
    if mesh.tensor > 1:
        groups.tensor = create(mesh.groups(TENSOR))
    return groups


def init(world: World, device: torch.device, timeout: float) -> None:
    """Join the process group (gloo on CPU, NCCL on CUDA)."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=world.rank,
                            world_size=world.size, timeout=timedelta(seconds=timeout))


def report_layout(plan: Plan, world: World, say) -> None:
    """On several nodes, rank 0 says which global ranks form each pipeline, on which nodes, and
    which pipeline links cross nodes (executors/rank_layout.py). Every rank takes part."""
    if world.nodes == 1:
        return
    node_of = [0] * world.size
    dist.all_gather_object(node_of, world.node)
    if world.rank == 0:
        for line in describe_layout(plan.header.mesh.value, node_of):
            say(line)


def backend_cause(e: Exception) -> str:
    """The useful words of a backend error: gloo's "[.../pair.cc:537] Read error [addr]:port:
    Connection reset by peer. This is typically caused by..." becomes "Connection reset by peer"."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # the source position of the backend
    text = text.split(". This is typically")[0]
    if text.startswith("Read error") or text.startswith("Write error"):
        text = text.split(": ", 1)[-1] if ": " in text else text
    return text


