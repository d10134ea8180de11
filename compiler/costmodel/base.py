"""`CostModel`: what the optimiser, the plan search, the simulator and memory accounting ask of
a cost model, in one base class.

Times are seconds (or abstract units, `time_unit`), sizes bytes (or slice activations,
`memory_unit`). A "slice" is `l` tokens of every sequence of a micro-batch of `mb_size`
sequences, with `c` tokens of context (the KV cache) before it. `stage` indexes the pipeline
stages the model was built for.

A model implements the five required methods; every other method has a default here, which a
model overrides where it knows better:

    slice_time(stage, l, c, mb_size) -> (forward, backward)     required
    p2p_time(nbytes)                                            required
    activation_bytes(l, mb_size)                                required
    kv_bytes(stage, l, mb_size)                                 required
    param_bytes(stage)                                          required

    slice_times(stage, l, c, mb)         the same over numpy arrays (the optimiser evaluates
                                         hundreds of thousands of points): slice_time per point
    split_backward_time(stage, l, c, mb_size)
                                         (backward-input, backward-weight): half the backward each
    stash_bytes(stage, l, c, mb_size)    what a forward keeps for its backward: activation_bytes
    held_grad_bytes(stage, l, c, mb_size)
                                         what a split backward keeps from its input half to its
                                         weight half, beyond the stash: 0
    message_bytes(l, mb_size)            a received activation or gradient: activation_bytes
    kv_slice_bytes(stage, lengths, mb)   the KV cache charged to each slice: kv_bytes of each
    allreduce_time(nbytes, n)            a ring all-reduce: 2(n-1) steps of nbytes/n
    allreduce_times(nbytes, n)           the same over an array of sizes
    grad_sync_time(stage, data)          allreduce_time(param_bytes(stage), data)
    tied_bytes(name)                     a tied parameter's gradient: 0 (taken as small)
    distinct_stages()                    stages whose costs cover all others: every stage
    activation_bytes_array(l, mb), p2p_times(nbytes)
                                         the array forms, point by point
    describe()                           one line for reports
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


# Tensor parallelism (Megatron-LM's layout): per decoder layer, one all-reduce of the layer's
# activation after the attention's output projection and one after the MLP's down projection in
# the forward (g), and one before the QKV projection and one before the MLP's up projection in the
# backward (f); the vocabulary-parallel token embedding adds one in the forward. Every cost model
# that prices a tensor split counts these (analytic.py, graph.py, profiled.py).
TENSOR_ALLREDUCES_PER_LAYER = 2


def tensor_allreduces(layers: int, first_unit: bool, tensor: int) -> tuple[int, int]:
    """The tensor group's (forward, backward) all-reduces of the activation in a unit of
    `layers` decoder layers (the first unit holding the token embedding) split over `tensor`
    ranks: none without a tensor axis."""
    if tensor <= 1:
        return 0, 0
    n = TENSOR_ALLREDUCES_PER_LAYER * layers
    return n + int(first_unit), n


class CostModel(ABC):
    num_stages: int = 1
    time_unit: str = "s"
    memory_unit: str = "B"

    # ------------------------------------------------------------------------- required

    @abstractmethod
    def slice_time(self, stage: int, l: int, c: int, mb_size: int) -> tuple[float, float]:
        """(forward, backward) of one slice on one stage."""

    @abstractmethod
    def p2p_time(self, nbytes: float) -> float:
        """Time to move `nbytes` from one stage's rank to the next's."""

    @abstractmethod
    def activation_bytes(self, l: int, mb_size: int) -> float:
        """Bytes of the activation one slice sends to the next stage (and of its gradient)."""

    @abstractmethod
    def kv_bytes(self, stage: int, l: int, mb_size: int) -> float:
        """Bytes of the KV cache `l` tokens leave on `stage` (kept until their backward)."""

    @abstractmethod
    def param_bytes(self, stage: int) -> float:
        """Bytes of the parameters of `stage` (on one rank)."""

    # ------------------------------------------------------------------------- defaults

    def slice_times(self, stage: int, l, c, mb) -> tuple[np.ndarray, np.ndarray]:
        """`slice_time` over arrays l, c, mb broadcast together: (forward, backward) arrays."""
        return _elementwise(self.slice_time, stage, l, c, mb)

    def split_backward_time(self, stage: int, l: int, c: int, mb_size: int) -> tuple[float, float]:
        """(backward-input, backward-weight) of a split backward: half the backward each."""
        half = self.slice_time(stage, l, c, mb_size)[1] / 2
        return half, half

    def split_backward_times(self, stage: int, l, c, mb) -> tuple[np.ndarray, np.ndarray]:
        """`split_backward_time` over arrays l, c, mb broadcast together."""
        if type(self).split_backward_time is CostModel.split_backward_time:  # halves of `slice_times`
            b = self.slice_times(stage, l, c, mb)[1]
            return b / 2, b / 2
        return _elementwise(self.split_backward_time, stage, l, c, mb)

    def stash_bytes(self, stage: int, l: int, c: int, mb_size: int) -> float:
        """Bytes a slice's forward keeps for its backward."""
        return self.activation_bytes(l, mb_size)

    def message_bytes(self, l: int, mb_size: int) -> float:
        """Bytes of a received activation or gradient while it waits for the compute that uses
        it (compiler/predict/memory.py, "messages"): the activation's."""
        return self.activation_bytes(l, mb_size)

    def held_grad_bytes(self, stage: int, l: int, c: int, mb_size: int) -> float:
        """Bytes a split backward of one slice keeps from `backward-input` to `backward-weight`
        beyond the stash: the output gradients of the ops that join a parameter with an
        activation (dY of dW = dY^T X; compiler/programs/joint.py). 0 where the model does not
        know them."""
        return 0.0

    def kv_slice_bytes(self, stage: int, lengths: tuple[int, ...], mb_size: int) -> list[float]:
        """KV-cache bytes charged to each slice of a micro-batch cut into slices of `lengths`
        on `stage`: each slice's own `kv_bytes` (a model that knows sliding-window layers,
        whose cache is bounded by the window, charges less)."""
        return [self.kv_bytes(stage, n, mb_size) for n in lengths]

    def allreduce_time(self, nbytes: float, n: int) -> float:
        """Time to sum `nbytes` over `n` ranks: a ring (2(n-1) steps of nbytes/n each, the
        bandwidth-optimal algorithm NCCL and gloo use for large tensors)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return 2 * (n - 1) * self.p2p_time(nbytes / n)

    def allreduce_times(self, nbytes, n: int) -> np.ndarray:
        """`allreduce_time` over an array of sizes."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        if n <= 1:
            return np.zeros(nbytes.shape)
        return np.where(nbytes > 0, 2 * (n - 1) * np.asarray(self.p2p_times(nbytes / n), dtype=np.float64), 0.0)

    def grad_sync_time(self, stage: int, data: int) -> float:
        """Time to sum a stage's gradients over `data` replicas."""
        return self.allreduce_time(self.param_bytes(stage), data)

    def tied_bytes(self, name: str) -> float:
        """Bytes of a tied parameter's gradient (summed over the ranks holding it)."""
        return 0.0

    def distinct_stages(self) -> tuple[int, ...]:
        """Stages whose costs cover all others (96 identical stages are priced once)."""
        return tuple(range(self.num_stages))

    def activation_bytes_array(self, l, mb) -> np.ndarray:
        l, mb = np.broadcast_arrays(np.asarray(l), np.asarray(mb))
        return np.vectorize(lambda a, b: float(self.activation_bytes(int(a), int(b))),
                            otypes=[np.float64])(l, mb)

    def p2p_times(self, nbytes) -> np.ndarray:
        return np.vectorize(lambda n: self.p2p_time(int(n)), otypes=[np.float64])(np.asarray(nbytes))

    def describe(self) -> str:
        return type(self).__name__


class TokenParts:
    """A cost model's prices for a plan with `sequence-parallel` (a mesh with a tensor axis of
    `parts` ranks): each message between stages carries a tensor rank's 1/`parts` of a slice's
    tokens, so transfers (`p2p_time`) and received messages (`message_bytes`) are 1/`parts` of
    the model's. Everything else is the model's own; what a stage keeps between the regions
    (the stash of its norms and residual adds, also 1/`parts` of the tokens) is not lowered."""

    def __init__(self, inner: CostModel, parts: int):
        self.inner, self.parts = inner, parts

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def p2p_time(self, nbytes: float) -> float:
        return self.inner.p2p_time(nbytes / self.parts)

    def p2p_times(self, nbytes) -> np.ndarray:
        return self.inner.p2p_times(np.asarray(nbytes) / self.parts)

    def message_bytes(self, l: int, mb_size: int) -> float:
        return self.inner.message_bytes(l, mb_size) / self.parts

    def describe(self) -> str:
        return f"{self.inner.describe()}, sequence-parallel"


def slot_times(cost: CostModel, l, c, mb, backward: bool = True) -> np.ndarray:
    """Time one slice occupies the bottleneck stage: forward + backward + the two transfers
    (with `backward=False`, for a forward-only program: forward + one transfer).

    The pipeline latency formula of TeraPipe assumes identical stages; with unequal stages
    (embedding on the first, the LM head on the last) the slowest stage sets both the rate of
    the steady state and, conservatively, the fill, so the slot is the maximum over stages.
    Transfers are blocking (a stage sends its activation, and later the gradient of its input,
    before it moves on), so they add to the slot when there is more than one stage.
    """
    l = np.asarray(l)
    mb = np.asarray(mb)
    worst = None
    for s in cost.distinct_stages():
        f, b = cost.slice_times(s, l, c, mb)
        t = np.asarray(f, dtype=np.float64)
        if backward:
            t = t + np.asarray(b, dtype=np.float64)
        worst = t if worst is None else np.maximum(worst, t)
    return worst + transfer_times(cost, l, mb, backward)


def transfer_times(cost: CostModel, l, mb, backward: bool = True) -> np.ndarray:
    """The blocking transfers a slice adds to its slot: its activation forward and its
    gradient back (only the activation without `backward`; none with a single stage)."""
    l = np.asarray(l)
    if cost.num_stages <= 1:
        return np.zeros(np.broadcast(l, np.asarray(mb)).shape)
    nbytes = np.asarray(cost.activation_bytes_array(l, mb), dtype=np.float64)
    return (2 if backward else 1) * np.asarray(cost.p2p_times(nbytes), dtype=np.float64)


def _elementwise(pair, stage: int, l, c, mb) -> tuple[np.ndarray, np.ndarray]:
    """`pair(stage, l, c, mb) -> (a, b)` of one slice, over arrays l, c, mb broadcast together."""
    l, c, mb = np.broadcast_arrays(np.asarray(l), np.asarray(c), np.asarray(mb))
    a = np.empty(l.shape)
    b = np.empty(l.shape)
    for idx in np.ndindex(l.shape):
        a[idx], b[idx] = pair(stage, int(l[idx]), int(c[idx]), int(mb[idx]))
    return a, b
