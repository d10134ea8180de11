"""Deterministic batches, and the rows of them each rank trains on.

A batch source is anything with `get(step) -> tokens`, an int64 tensor of shape (batch, seq+1):
ids are `tokens[:, :-1]`, targets `tokens[:, 1:]`. Every rank asks for the same step and gets
the same global batch without communication; it then keeps only its replica's rows and, per
micro-batch, the rows the plan's header assigns to it. A step runs on a `Batch`: the ids and
targets of the global batch, cut from tokens (`Batch.of`) or given apart (a library user's
`step(inputs, targets)`, whose targets need not be the shifted ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tpc.ir.nodes import Header


class BatchSource(Protocol):
    def get(self, step: int) -> torch.Tensor:
        """(batch, seq+1) int64 tokens of training step `step`."""
        ...


class RandomTokens:
    """Uniform random tokens, seeded by (seed, step): the same batch for a step on every rank and
    in every run, independent of which steps were drawn before (a resumed run sees the same data)."""

    def __init__(self, seed: int, batch: int, seq: int, vocab: int):
        self.seed, self.batch, self.seq, self.vocab = seed, batch, seq, vocab

    def get(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_mix(self.seed, step))
        return torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=g, dtype=torch.int64)


def _mix(seed: int, step: int) -> int:
    """One generator seed from (seed, step); distinct pairs give distinct seeds for any
    step < 2**32, and the result fits torch's 64-bit seed."""
    return ((seed & 0x7FFFFFFF) << 32 | (step & 0xFFFFFFFF)) & 0x7FFFFFFFFFFFFFFF


@dataclass(frozen=True)
class Batch:
    """The ids and the targets of a global batch, each (rows, seq) int64."""

    ids: torch.Tensor
    targets: torch.Tensor

    @staticmethod
    def of(batch: "Batch | torch.Tensor") -> "Batch":
        """`batch` itself, or the ids and next-token targets of a (rows, seq+1) token block."""
        if isinstance(batch, Batch):
            return batch
        ids, targets = split_tokens(batch)
        return Batch(ids, targets)

    def rows(self, lo: int, hi: int) -> "Batch":
        return Batch(self.ids[lo:hi], self.targets[lo:hi])

    def to(self, device: torch.device) -> "Batch":
        """On `device`; from the CPU to CUDA through pinned memory, without waiting for the
        stream (the loads then cut the micro-batches from it on the device)."""
        if self.ids.device.type == "cpu" and device.type == "cuda":
            return Batch(self.ids.pin_memory().to(device, non_blocking=True),
                         self.targets.pin_memory().to(device, non_blocking=True))
        return self


def split_tokens(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets): the inputs and the next-token labels of a (rows, seq+1) token block."""
    return tokens[:, :-1], tokens[:, 1:]


def replica_rows(header: Header, data_rank: int) -> tuple[int, int]:
    """[start, end) rows of the global batch that data-parallel replica `data_rank` trains on."""
    per = header.replica_batch
    return data_rank * per, (data_rank + 1) * per


def microbatch(batch: Batch, header: Header, data_rank: int, mb: int) -> Batch:
    """The rows of micro-batch `mb` of replica `data_rank` of a global batch."""
    r0, _ = replica_rows(header, data_rank)
    lo, hi = header.microbatch_rows(mb)
    return batch.rows(r0 + lo, r0 + hi)
