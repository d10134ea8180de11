"""Cost model from a measured profile: per-unit fits summed over each stage's units.

Micro-batch sizes between measured ones are interpolated linearly; beyond the measured range
the time scales in proportion to the rows (below the smallest: optimistic about nothing; above
the largest: assumes the device is already saturated, which is what large micro-batches do).
The stash (bytes a slice's forward keeps for its backward) is interpolated the same way, and
so are the two halves of a split backward (`split_backward_time`), measured apart by
`tpc profile`.

A profile is measured on unsplit stages. Priced for a tensor group of T ranks (`tensor`, `tpc
compile --tensor T`), a unit's measured compute is divided by T, and the group's all-reduces of
the activation are added (`base.tensor_allreduces`: two per decoder layer -- a unit with a KV
cache -- each way, one more for the first unit's embedding), each the ring all-reduce
`CostModel.allreduce_time` on the profile's measured link; a split backward's input half carries
the backward's all-reduces. The memory of parameters, gradients, KV cache and stash is divided
by T. This is an estimate, not a measurement of the split stages.
"""

from __future__ import annotations

import numpy as np

from tpc.compiler.costmodel.base import CostModel, tensor_allreduces
from tpc.compiler.costmodel.store import Profile


class ProfiledCostModel(CostModel):
    def __init__(self, profile: Profile, stage_units, tensor: int = 1):
        if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1:
            raise ValueError(f"tensor degree must be a positive whole number, got {tensor!r}")
        self.tensor = tensor
        ranges = [tuple(int(v) for v in r) for r in stage_units]
        ends = [0] + [hi for _, hi in ranges]
        if not ranges or ends[-1] != profile.num_units or any(
                lo != prev or lo >= hi for (lo, hi), prev in zip(ranges, ends)):
            raise ValueError(f"stage unit ranges {ranges} do not cover units 0:{profile.num_units} in order")
        self.profile = profile
        self.stage_units = tuple(ranges)
        self.num_stages = len(ranges)
        self._sizes = np.asarray(profile.batch_sizes, dtype=np.float64)
        self._stash: dict[tuple, int] = {}  # memory accounting asks once per forward of a plan

    def _unit_time(self, fits, l, c, mb):
        """Interpolate one unit's per-size fits at micro-batch sizes `mb` (arrays broadcast);
        `fits` are callables f(l, c), one per measured size: time curves or stash fits."""
        sizes = self._sizes
        per_size = np.stack([np.broadcast_to(f(l, c), np.broadcast(l, c, mb).shape) for f in fits])
        mb = np.broadcast_to(np.asarray(mb, dtype=np.float64), per_size.shape[1:])
        if len(sizes) == 1:
            return per_size[0] * mb / sizes[0]
        hi = np.clip(np.searchsorted(sizes, mb), 1, len(sizes) - 1)
        lo = hi - 1
        t_lo = np.take_along_axis(per_size, lo[None], 0)[0]
        t_hi = np.take_along_axis(per_size, hi[None], 0)[0]
        w = (mb - sizes[lo]) / (sizes[hi] - sizes[lo])
        inside = t_lo + w * (t_hi - t_lo)
        below = per_size[0] * mb / sizes[0]
        above = per_size[-1] * mb / sizes[-1]
        return np.where(mb < sizes[0], below, np.where(mb > sizes[-1], above, inside))

    def slice_times(self, stage, l, c, mb):
        l = np.asarray(l, dtype=np.float64)
        c = np.asarray(c, dtype=np.float64)
        mb = np.asarray(mb, dtype=np.float64)
        lo, hi = self.stage_units[stage]
        f = b = 0.0
        for u in self.profile.units[lo:hi]:
            f = f + self._unit_time(u.fwd, l, c, mb)
            b = b + self._unit_time(u.bwd, l, c, mb)
        if self.tensor == 1:
            return f, b
        ar_f, ar_b = self._tensor_collectives(stage, l, mb)
        return f / self.tensor + ar_f, b / self.tensor + ar_b

    def _tensor_collectives(self, stage, l, mb):
        """(forward, backward) seconds of the tensor group's all-reduces in a slice of `stage`."""
        lo, hi = self.stage_units[stage]
        n_f = n_b = 0
        for i, u in enumerate(self.profile.units[lo:hi], lo):
            fw, bw = tensor_allreduces(int(u.kv_bytes_per_token > 0), i == 0, self.tensor)
            n_f, n_b = n_f + fw, n_b + bw
        one = self.allreduce_times(np.asarray(self.activation_bytes_array(l, mb)), self.tensor)
        return n_f * one, n_b * one

    def slice_time(self, stage: int, l: int, c: int, mb_size: int) -> tuple[float, float]:
        f, b = self.slice_times(stage, l, c, mb_size)
        return float(f), float(b)

    def split_backward_times(self, stage, l, c, mb):
        """Vectorised `split_backward_time`: (t_input, t_weight) arrays over broadcast l, c, mb."""
        l = np.asarray(l, dtype=np.float64)
        c = np.asarray(c, dtype=np.float64)
        mb = np.asarray(mb, dtype=np.float64)
        lo, hi = self.stage_units[stage]
        units = self.profile.units[lo:hi]
        n = len(self._sizes)
        if any(len(u.bwd_input) != n or len(u.bwd_weight) != n for u in units):
            _, b = self.slice_times(stage, l, c, mb)
            return b / 2, b / 2
        t_in = t_w = 0.0
        for u in units:
            t_in = t_in + self._unit_time(u.bwd_input, l, c, mb)
            t_w = t_w + self._unit_time(u.bwd_weight, l, c, mb)
        if self.tensor == 1:
            return t_in, t_w
        return t_in / self.tensor + self._tensor_collectives(stage, l, mb)[1], t_w / self.tensor

    def split_backward_time(self, stage: int, l: int, c: int, mb_size: int) -> tuple[float, float]:
        """(backward-input, backward-weight) seconds of one slice on one stage: the stage's
        units' measured fits of each half, summed like `slice_time`. They need not split the
        backward evenly (attention's backward belongs to the input half; an embedding has no
        input gradient at all) and together cost more than one plain backward. A profile without
        them (built in memory, e.g. a synthetic one) prices each half as half the backward, as
        the simulator does for a cost model without this method."""
        t_in, t_w = self.split_backward_times(stage, l, c, mb_size)
        return float(t_in), float(t_w)

    def p2p_times(self, nbytes):
        p = self.profile
        return p.link_latency + np.asarray(nbytes, dtype=np.float64) / p.link_bandwidth

    def p2p_time(self, nbytes: int) -> float:
        return float(self.p2p_times(nbytes))

    def activation_bytes(self, l: int, mb_size: int) -> int:
        return int(l * mb_size * self.profile.act_bytes_per_token)

    def activation_bytes_array(self, l, mb):
        return np.asarray(l, dtype=np.float64) * mb * self.profile.act_bytes_per_token

    def kv_bytes(self, stage: int, l: int, mb_size: int) -> int:
        lo, hi = self.stage_units[stage]
        return int(sum(u.kv_bytes_per_token for u in self.profile.units[lo:hi]) * l * mb_size / self.tensor)

    def stash_bytes(self, stage: int, l: int, c: int, mb_size: int) -> int:
        """Bytes a slice's forward keeps for its backward: the stage's units' measured stash
        fits. A profile without them (built in memory, e.g. a synthetic one) prices the
        boundary activation, as a cost model without `stash_bytes` would."""
        key = (stage, l, c, mb_size)
        if key not in self._stash:
            lo, hi = self.stage_units[stage]
            units = self.profile.units[lo:hi]
            if any(len(u.stash) != len(self._sizes) for u in units):
                self._stash[key] = self.activation_bytes(l, mb_size)
            else:
                args = np.float64(l), np.float64(c), np.float64(mb_size)
                self._stash[key] = int(sum(float(self._unit_time(u.stash, *args)) for u in units) / self.tensor)
        return self._stash[key]

    def held_grad_bytes(self, stage: int, l: int, c: int, mb_size: int) -> int:
        """What a split backward keeps between its halves: the stage's units' measured fits
        (`tpc profile`); 0 for a profile without them (built in memory)."""
        lo, hi = self.stage_units[stage]
        units = self.profile.units[lo:hi]
        if any(len(u.held) != len(self._sizes) for u in units):
            return 0
        args = np.float64(l), np.float64(c), np.float64(mb_size)
        return int(sum(float(self._unit_time(u.held, *args)) for u in units) / self.tensor)

    def param_bytes(self, stage: int) -> int:
        lo, hi = self.stage_units[stage]
        return int(sum(u.param_bytes for u in self.profile.units[lo:hi]) / self.tensor)

    def unit_times(self, l: int, c: int, mb: int) -> list[float]:
        """Forward + backward of every unit for one slice: what a stage partition balances."""
        out = []
        for u in self.profile.units:
            f = self._unit_time(u.fwd, np.float64(l), np.float64(c), np.float64(mb))
            b = self._unit_time(u.bwd, np.float64(l), np.float64(c), np.float64(mb))
            out.append(float(f + b))
        return out

    def describe(self) -> str:
        p = self.profile
        # the fits' error as a share of the model's time: a sub-millisecond unit fitted within
        # 400% of its own time moves a step by far less than that (Profile.fit_error_share)
        return (f"profile of {p.model_path} on {p.device}: {p.num_units} units, "
                f"fits within {p.fit_error_share():.2%} of the model's time"
                + (f"; split over {self.tensor} tensor ranks (compute / {self.tensor}, all-reduces added)"
                   if self.tensor > 1 else ""))
