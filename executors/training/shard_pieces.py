"""Parts of a tensor, each a flat range of its elements, as torch.distributed.checkpoint stores them.

A sharded optimizer (`sharded_optimizer.py`) keeps, of each parameter's AdamW state, only the
elements in its data-parallel rank's range of the stage's flat buffer: a contiguous range
[a, b) of the tensor's elements in row-major order, which is in general no rectangle of the
tensor (it may start and end inside a row). DCP stores a tensor as rectangular chunks (offsets
and sizes per dimension), so a range is written as the few rectangles that tile it
(`range_boxes`: a partial first row, whole rows, a partial last row, recursively).

`Pieces` is a checkpoint entry made of such rectangles, each a view of live storage. It follows
DCP's checkpointable protocol (the three `__..__` methods DTensor implements), so a checkpoint
holding it has, under the entry's key, the whole tensor's shape with each rank's chunks; any
other layout reads it back: a run with another data-parallel size (other ranges), or without
sharding (one whole tensor), reads the same key, and DCP copies the overlap of what is stored
and what is asked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The rectangles (offsets, sizes) that tile the elements [lo, hi) of a row-major tensor of
    `shape`, in element order; each one's elements are contiguous in that order."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    first, last = lo // row, (hi - 1) // row
    inner = shape[1:]

    def within(i: int, a: int, b: int):
        return [((i, *o), (1, *s)) for o, s in range_boxes(inner, a, b)]

    if first == last:
        return within(first, lo - first * row, hi - first * row)
    out = []
    start = first
    if lo % row:
        out += within(first, lo % row, row)
        start = first + 1
    end = last + 1 if hi % row == 0 else last
    if end > start:
        out.append(((start, *([0] * len(inner))), (end - start, *inner)))
    if hi % row:
        out += within(last, 0, hi % row)
    return out


@dataclass
class Part:
    """Elements [lo, hi) of the whole tensor, held in `flat` (a 1-D view of live storage)."""

    lo: int
    hi: int
    flat: torch.Tensor


class Chunks:
    """A checkpoint entry: rectangles of a tensor of `shape` and `dtype`, each (offsets, sizes,
    a view of live storage holding it): saving reads the views, loading fills them in place.
    The rectangles of every holder of a key together tile the tensor exactly once (DCP checks
    the chunks of a save cover it). A tensor rank's part of a weight cut over the tensor axis
    is one rectangle per segment (compiler/tensor ParamShard)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype,
                 boxes: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]):
        self.shape, self.dtype = tuple(shape), dtype
        self._boxes = list(boxes)

    def merged(self, other: "Chunks") -> "Chunks":
        """These rectangles and `other`'s (the holders of one process: the interpreter's ranks)."""
        return Chunks(self.shape, self.dtype, self._boxes + other._boxes)

    @property
    def numel(self) -> int:
        return sum(math.prod(sizes) for _, sizes, _ in self._boxes)

    # --------------------------------------------------------- DCP's checkpointable protocol

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                              properties=TensorProperties.create_from_tensor(view), size=torch.Size(self.shape)))
                for offsets, sizes, view in self._boxes]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in self._boxes]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for offsets, _, view in self._boxes:
            if torch.Size(offsets) == index.offset:
                return view
        raise ValueError(f"{index.fqn}: no part at offsets {tuple(index.offset)}")


class Pieces(Chunks):
    """A checkpoint entry: some flat ranges of a tensor of `shape` and `dtype`, in live tensors
    (the module docstring): each range written as the rectangles that tile it."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, parts: list[Part]):
        self.parts = sorted(parts, key=lambda p: p.lo)
        boxes = []
        for part in self.parts:
            at = part.lo
            for offsets, sizes in range_boxes(tuple(shape), part.lo, part.hi):
                n = math.prod(sizes)
                boxes.append((offsets, sizes, part.flat[at - part.lo: at - part.lo + n].view(sizes)))
                at += n
        super().__init__(shape, dtype, boxes)

    def merged(self, other: "Pieces") -> "Pieces":
        """These parts and `other`'s (the holders of one process: the interpreter's replicas)."""
        return Pieces(self.shape, self.dtype, self.parts + other.parts)

    @property
    def numel(self) -> int:
        return sum(p.hi - p.lo for p in self.parts)


def _lookup(state_dict, index):
    """The tensor of `index`: a `Chunks` entry's rectangle at the index's offsets, else DCP's own."""
    from torch.distributed.checkpoint.utils import find_state_dict_object

    obj = state_dict.get(index.fqn)
    if isinstance(obj, Chunks):
        return obj.__get_tensor_shard__(index)
    return find_state_dict_object(state_dict, index)


def save_planner():
    """DCP's default save planner, finding a `Chunks` entry's rectangles (DCP looks up by
    offsets only in tensors)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class PiecesSavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            return _lookup(self.state_dict, index)

    return PiecesSavePlanner()


def load_planner():
    """DCP's default load planner, filling a `Chunks` entry's rectangles in place."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class PiecesLoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # DCP's set-up turns entries it does not know into None: hide ours from it
            hidden: list[tuple[dict, str, str, Chunks]] = []

            def hide(tree: dict, prefix: str) -> None:
                for k, v in tree.items():
                    key = f"{prefix}.{k}" if prefix else k
                    if isinstance(v, Chunks):
                        hidden.append((tree, k, key, v))
                        tree[k] = None
                    elif isinstance(v, dict):
                        hide(v, key)

            hide(state_dict, "")
            super().set_up_planner(state_dict, metadata, is_coordinator)
            for tree, k, key, v in hidden:
                tree[k] = v
                self.state_dict[key] = v

        def lookup_tensor(self, index):
            return _lookup(self.state_dict, index)

    return PiecesLoadPlanner()
