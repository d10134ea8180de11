"""`UnitCosts`: the textbook cost model, for reasoning about schedules and for `tpc simulate
--unit`: forward 1, backward 2 per slice, free communication."""

from __future__ import annotations

from dataclasses import dataclass

from tpc.compiler.costmodel.base import CostModel
from tpc.ir.nodes import Header


@dataclass(frozen=True)
class UnitCosts(CostModel):
    """The textbook cost model: forward 1, backward 2 per slice, free communication.

    With `ref_len` set, a slice of length l costs l / ref_len forwards (so slices of unequal
    length cost in proportion; `for_plan` sets it to the plan's mean slice length, so an
    average slice still costs 1). Memory is counted in slice activations: each live slice
    graph is `activation_bytes` (1, or l / ref_len), parameters and KV caches count 0.
    `p2p` is the time of every transfer (0 by default).
    """

    forward: float = 1.0
    backward: float = 2.0
    ref_len: float | None = None
    p2p: float = 0.0
    time_unit: str = "unit"
    memory_unit: str = "act"

    @classmethod
    def for_plan(cls, header: Header, **kw) -> "UnitCosts":
        """Unit costs scaled by slice length, an average slice of the plan costing 1."""
        n = sum(len(m.slices) for m in header.microbatches)
        return cls(ref_len=header.shape.seq * len(header.microbatches) / max(n, 1), **kw)

    def _scale(self, l: int) -> float:
        return 1.0 if self.ref_len is None else l / self.ref_len

    def slice_time(self, stage: int, l: int, c: int, mb_size: int) -> tuple[float, float]:
        return self.forward * self._scale(l), self.backward * self._scale(l)

    def p2p_time(self, nbytes: float) -> float:
        return self.p2p

    def activation_bytes(self, l: int, mb_size: int) -> float:
        return self._scale(l)

    def kv_bytes(self, stage: int, l: int, mb_size: int) -> float:
        return 0.0

    def message_bytes(self, l: int, mb_size: int) -> float:
        return 0.0  # the textbook figures count slice activations only

    def param_bytes(self, stage: int) -> float:
        return 0.0

    def describe(self) -> str:
        scaled = ", scaled by slice length" if self.ref_len is not None else ""
        return f"unit costs (forward {self.forward:g}, backward {self.backward:g} per slice{scaled})"
