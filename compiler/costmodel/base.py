"""The cost-model protocol: what the optimiser, the simulator and compile ask of a cost model.

Times are seconds, sizes bytes. A "slice" is `l` tokens of every sequence of a micro-batch of
`mb_size` sequences, with `c` tokens of context (the KV cache) before it. `stage` indexes the
pipeline stages the model was built for.

A model may also provide `slice_times(stage, l, c, mb)` taking numpy arrays (broadcast
together) and returning `(t_fwd, t_bwd)` arrays; the optimiser evaluates hundreds of thousands
of (l, c, mb) points and uses it when present. `slice_times_of` falls back to the scalar method.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class CostModel(Protocol):
    num_stages: int

    def slice_time(self, stage: int, l: int, c: int, mb_size: int) -> tuple[float, float]:
        """(forward, backward) seconds of one slice on one stage."""
        ...

    def p2p_time(self, nbytes: int) -> float:
        """Seconds to move `nbytes` from one stage's rank to the next's."""
        ...

    def activation_bytes(self, l: int, mb_size: int) -> int:
        """Bytes of the activation one slice sends to the next stage (and of its gradient)."""
        ...

    def kv_bytes(self, stage: int, l: int, mb_size: int) -> int:
        """Bytes of the KV cache `l` tokens leave on `stage` (kept until their backward)."""
        ...

    def param_bytes(self, stage: int) -> int:
        """Bytes of the parameters of `stage` (on one rank)."""
        ...


def slice_times_of(cost: CostModel, stage: int, l, c, mb) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised (t_fwd, t_bwd) over broadcast arrays l, c, mb, using the model's fast path."""
    fast = getattr(cost, "slice_times", None)
    if fast is not None:
        f, b = fast(stage, l, c, mb)
        return np.asarray(f, dtype=np.float64), np.asarray(b, dtype=np.float64)
    l, c, mb = np.broadcast_arrays(np.asarray(l), np.asarray(c), np.asarray(mb))
    f = np.empty(l.shape)
    b = np.empty(l.shape)
    for idx in np.ndindex(l.shape):
        f[idx], b[idx] = cost.slice_time(stage, int(l[idx]), int(c[idx]), int(mb[idx]))
    return f, b


def slot_times(cost: CostModel, l, c, mb) -> np.ndarray:
    """Time one slice occupies the bottleneck stage: forward + backward + the two transfers.

    The pipeline latency formula of TeraPipe assumes identical stages; with unequal stages
    (embedding on the first, the LM head on the last) the slowest stage sets both the rate of
    the steady state and, conservatively, the fill, so the slot is the maximum over stages.
    Transfers are blocking (a stage sends its activation, and later the gradient of its input,
    before it moves on), so they add to the slot when there is more than one stage.
    """
    l = np.asarray(l)
    mb = np.asarray(mb)
    worst = None
    for s in representative_stages(cost):
        f, b = slice_times_of(cost, s, l, c, mb)
        t = f + b
        worst = t if worst is None else np.maximum(worst, t)
    return worst + transfer_times(cost, l, mb)


def transfer_times(cost: CostModel, l, mb) -> np.ndarray:
    """The blocking transfers a slice adds to its slot: its activation forward and its
    gradient back (none with a single stage)."""
    l = np.asarray(l)
    if cost.num_stages <= 1:
        return np.zeros(np.broadcast(l, np.asarray(mb)).shape)
    return 2 * _p2p_times_of(cost, _activation_bytes_of(cost, l, mb))


def representative_stages(cost: CostModel) -> tuple[int, ...]:
    """Stages whose costs cover all others: a model may say which are alike (`distinct_stages`),
    so the bottleneck over 96 identical stages is priced once, not 96 times."""
    fn = getattr(cost, "distinct_stages", None)
    return tuple(fn()) if fn is not None else tuple(range(cost.num_stages))


def _activation_bytes_of(cost: CostModel, l, mb) -> np.ndarray:
    fast = getattr(cost, "activation_bytes_array", None)
    if fast is not None:
        return np.asarray(fast(l, mb), dtype=np.float64)
    l, mb = np.broadcast_arrays(np.asarray(l), np.asarray(mb))
    return np.vectorize(lambda a, b: float(cost.activation_bytes(int(a), int(b))),
                        otypes=[np.float64])(l, mb)


def _p2p_times_of(cost: CostModel, nbytes: np.ndarray) -> np.ndarray:
    fast = getattr(cost, "p2p_times", None)
    if fast is not None:
        return np.asarray(fast(nbytes), dtype=np.float64)
    return np.vectorize(lambda n: cost.p2p_time(int(n)), otypes=[np.float64])(nbytes)
