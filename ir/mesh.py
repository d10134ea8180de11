"""The device mesh as a value: named axes, rank <-> coordinates, and the groups of each axis.

A plan runs on a mesh of `pipe` pipeline ranks times `data` data-parallel replicas (the header's
`mesh pipe P data D`). Every process has one global rank; its coordinates say which pipeline
rank of which replica it is. This module is the only place in the tree that turns coordinates
into a global rank or back (tests/test_mesh_arithmetic.py fails on rank arithmetic anywhere
else), and the only place that says who belongs to a group.

The layout: the axes are listed fastest first, and a global rank is the mixed-radix number of its
coordinates. The axes are `tensor` (when its size is above 1), `pipe`, then `data`, so the global
rank of (tensor rank t, pipeline rank p, data rank d) is `(d * pipe + p) * tensor + t`: a stage's
tensor-parallel group is `tensor` consecutive ranks (torchrun numbers processes node by node, so
the group that talks most shares a node), each pipeline is `pipe x tensor` consecutive ranks, and
without a tensor axis the rank of (p, d) is `d * pipe + p`, as in plans written before the axis.
The T ranks of a tensor group run the same rank section of the plan, each on its part of the
stage's weights.

Groups are tuples of global ranks in ascending order, and every family of groups is listed in one
fixed order (`groups`), so every rank creates the same process groups in the same order, as
torch.distributed requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

PIPE, DATA, TENSOR = "pipe", "data", "tensor"


@dataclass(frozen=True)
class Mesh:
    """Named axes with their sizes, fastest first: `Mesh.of(pipe=4, data=2)`."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self):
        names = [n for n, _ in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axes must have distinct names, got {names}")
        for name, size in self.axes:
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {name!r} must have a size >= 1, got {size!r}")

    @staticmethod
    def of(pipe: int, data: int = 1, tensor: int = 1) -> "Mesh":
        """The mesh of a plan: `tensor` ranks a stage (fastest; no axis when 1) times `pipe`
        pipeline ranks times `data` replicas."""
        lead = ((TENSOR, tensor),) if tensor != 1 else ()
        return Mesh((*lead, (PIPE, pipe), (DATA, data)))

    # ------------------------------------------------------------------ sizes

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    def size_of(self, axis: str) -> int:
        for name, size in self.axes:
            if name == axis:
                return size
        raise KeyError(f"the mesh has no axis {axis!r} (its axes: {', '.join(self.names)})")

    @property
    def pipe(self) -> int:
        return self.size_of(PIPE)

    @property
    def data(self) -> int:
        return self.size_of(DATA)

    @property
    def tensor(self) -> int:
        """The tensor-parallel degree: the ranks sharing each stage's weights (1: no such axis)."""
        return self.size_of(TENSOR) if TENSOR in self.names else 1

    @property
    def size(self) -> int:
        """The number of processes (global ranks)."""
        n = 1
        for _, s in self.axes:
            n *= s
        return n

    # ------------------------------------------------------ rank <-> coordinates

    def rank(self, **coords: int) -> int:
        """The global rank at `coords` (an axis left out is at 0; `tensor=0` is accepted without
        a tensor axis): `mesh.rank(pipe=p, data=d)`."""
        # a plan without a tensor axis has every rank at tensor coordinate 0
        unknown = {k for k, v in coords.items() if k not in self.names and not (k == TENSOR and v == 0)}
        if unknown:
            raise KeyError(f"the mesh has no axis {sorted(unknown)[0]!r} (its axes: {', '.join(self.names)})")
        rank, stride = 0, 1
        for name, size in self.axes:
            c = coords.get(name, 0)
            if not 0 <= c < size:
                raise ValueError(f"{name} coordinate {c} is outside 0..{size - 1}")
            rank += c * stride
            stride *= size
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of global rank `rank`, by axis name."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the mesh's 0..{self.size - 1}")
        out = {}
        for name, size in self.axes:
            out[name] = rank % size
            rank //= size
        return out

    def coord(self, rank: int, axis: str) -> int:
        return self.coords(rank)[axis]

    def pipe_rank(self, rank: int) -> int:
        """The pipeline rank (the plan's `rank P` section) global rank `rank` runs."""
        return self.coord(rank, PIPE)

    def data_rank(self, rank: int) -> int:
        """The data-parallel replica global rank `rank` belongs to."""
        return self.coord(rank, DATA)

    def tensor_rank(self, rank: int) -> int:
        """Which part of its stages' weights global rank `rank` holds (0 without a tensor axis)."""
        return self.coord(rank, TENSOR) if TENSOR in self.names else 0

    def ranks(self) -> range:
        return range(self.size)

    # ------------------------------------------------------------------ groups

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks along `axis` through `rank`: every rank whose other coordinates are
        `rank`'s (its data-parallel group for DATA, its pipeline for PIPE)."""
        at = self.coords(rank)
        return tuple(self.rank(**{**at, axis: c}) for c in range(self.size_of(axis)))

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along `axis`, each once, ordered by its first rank: the order in which
        every process creates them."""
        seen, out = set(), []
        for r in self.ranks():
            g = self.group(axis, r)
            if g not in seen:
                seen.add(g)
                out.append(g)
        return out

    def select(self, pipe_ranks: Iterable[int], **fixed: int) -> tuple[int, ...]:
        """The global ranks of the given pipeline ranks at the `fixed` other coordinates (a
        replica's ranks holding a tie, a stage's weight replicas), ascending."""
        return tuple(sorted(self.rank(**fixed, **{PIPE: p}) for p in set(pipe_ranks)))

    def subgroups(self, pipe_ranks: Iterable[int]) -> list[tuple[int, ...]]:
        """`select(pipe_ranks, ...)` for every setting of the other axes, in a fixed order: the
        groups of a set of pipeline ranks in every replica (ties, weight replicas)."""
        pipe_ranks = sorted(set(pipe_ranks))
        others = [(n, s) for n, s in self.axes if n != PIPE]
        out, total = [], 1
        for _, s in others:
            total *= s
        for k in range(total):
            fixed, rest = {}, k
            for name, size in others:
                fixed[name] = rest % size
                rest //= size
            out.append(self.select(pipe_ranks, **fixed))
        return out

    def describe(self) -> str:
        return " x ".join(f"{n} {s}" for n, s in reversed(self.axes))


def tie_pipe_ranks(stage_ranks: Sequence[int | Sequence[int]], tie_stages: Iterable[int]) -> tuple[int, ...]:
    """The pipeline ranks holding a stage of a tie (the members of its `reduce-tied` within one
    data-parallel replica), ascending. `stage_ranks[s]` is the pipeline rank of stage s, or the
    ranks of all its weight replicas (format version 3): every rank holding any replica of a
    tied stage holds the tied tensor, so every one of them is a member, and the one reduction
    sums each replica's contribution once (`reduce-replicas` leaves tied parameters out). A
    stage index outside `stage_ranks` (a header the verifier is about to refuse) counts for
    nothing."""
    out: set[int] = set()
    for s in tie_stages:
        if 0 <= s < len(stage_ranks):
            got = stage_ranks[s]
            out.update((got,) if isinstance(got, int) else got)
    return tuple(sorted(out))
