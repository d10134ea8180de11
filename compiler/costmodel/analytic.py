"""Analytic cost model: a GPT layer's kernels, each timed by a roofline plus a launch cost.

It needs only the model's shapes (layers, hidden, heads, vocab), so it can price a 175B model
that nobody could trace on a laptop. Every kernel of a decoder layer's forward is listed with
its FLOPs and the bytes it must move; its time is

    launch_overhead + max(FLOPs / (peak * flops_efficiency), bytes / (bandwidth * mem_efficiency))

so a short slice, whose matmuls are too thin to amortise the weight reads and whose dozen
kernels each pay the launch cost, does less work per second than a long one: that loss of
efficiency is what stops the optimiser from cutting sequences into ever finer slices.

A device's `host_op_time` (the host's time to issue one kernel) is not applied here: it is
measured per kernel of the traced graph (graph.py), and this hand-written block lists about
1.6 times as many kernels per layer (54 against 33 for GPT-2 medium), so it would charge the
host 1.6 times too long. This model prices models too large to trace; for those, long slices
of wide layers keep the GPU, not the host, the bottleneck.

Backward: each matmul has two (input-gradient and weight-gradient) kernels of the forward's
size, each elementwise kernel reads and writes twice the bytes, each all-reduce repeats.
Operator (tensor) parallelism of degree `op` splits every matmul and the heads `op` ways and
adds two all-reduces of the layer output per layer in each direction (Megatron-LM's layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpc.compiler.costmodel.base import TENSOR_ALLREDUCES_PER_LAYER
from tpc.compiler.costmodel.on_device import DeviceCostModel
from tpc.compiler.costmodel.devices import DeviceSpec


@dataclass(frozen=True)
class ModelShapes:
    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn_mult: int = 4
    # bytes per element of weights and activations (fp16/bf16 training)
    dtype_bytes: int = 2
    # the token embedding on the first stage and the final norm, LM head and loss on the last
    with_embedding: bool = True
    with_head: bool = True

    def __post_init__(self):
        if min(self.layers, self.hidden, self.heads, self.vocab, self.ffn_mult) < 1:
            raise ValueError("model shapes must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")

    @property
    def layer_params(self) -> int:
        h, f = self.hidden, self.ffn_mult
        return (4 + 2 * f) * h * h + (9 + f) * h  # QKV, proj, fc1, fc2 + biases and norms


def even_layers(layers: int, stages: int) -> tuple[int, ...]:
    """Layers per stage, as even as possible, the remainder spread over the first stages."""
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot put {layers} layers on {stages} stages")
    q, r = divmod(layers, stages)
    return tuple(q + (1 if s < r else 0) for s in range(stages))


class AnalyticCostModel(DeviceCostModel):
    """CostModel for `shapes` cut into stages of `stage_layers` layers on `device` GPUs.

    `op` is the operator-parallel degree of every stage (the GPUs of one stage). Stage s of a
    replica sits on GPUs [s*op, (s+1)*op), packed into nodes of `device.gpus_per_node`.
    """

    def __init__(self, device: DeviceSpec, shapes: ModelShapes, stage_layers=None, op: int = 1):
        if op < 1 or shapes.heads % op or shapes.hidden % op:
            raise ValueError(f"operator-parallel degree {op} must divide heads and hidden")
        self.device = device
        self.shapes = shapes
        self.op = op
        self.stage_layers = tuple(stage_layers) if stage_layers is not None else (shapes.layers,)
        if sum(self.stage_layers) != shapes.layers or min(self.stage_layers) < 0:
            raise ValueError(f"stage layers {self.stage_layers} do not add up to {shapes.layers}")
        self.num_stages = len(self.stage_layers)

    # ------------------------------------------------------------------- kernel roofline

    def _kernel(self, flops, nbytes):
        d = self.device
        compute = flops / (d.peak_flops * d.flops_efficiency)
        memory = nbytes / (d.mem_bandwidth * d.mem_efficiency)
        return d.launch_overhead + np.maximum(compute, memory)

    def _allreduce(self, nbytes):
        """Ring all-reduce over the `op` GPUs of a stage (inside one node when op fits)."""
        return self.device.group_allreduce_time(nbytes, self.op)

    def _layer_times(self, l, c, b):
        """(forward, backward) seconds of one decoder layer for a slice: arrays broadcast.

        The kernels are those eager PyTorch runs for a Megatron-style GPT block: one per
        linear (bias fused), head split/merge copies, the KV-cache concatenation, two batched
        attention matmuls, mask, softmax, three dropouts, two residual adds, two layer norms,
        GELU, and with op > 1 two all-reduces.
        """
        s, p = self.shapes, self.op
        h, e, f = s.hidden, s.dtype_bytes, s.ffn_mult
        a = s.heads / p
        m = l * b  # tokens in the slice
        ctx = c + l  # keys each query of the slice may attend to (cache + itself)
        scores = b * a * l * ctx  # attention score elements on this GPU
        kern = self._kernel
        zero = 0 * m

        def ew(elems, passes=2):  # an elementwise kernel: `passes` reads/writes of `elems`
            return kern(zero, passes * elems * e)

        linears = ((h, 3 * h / p), (h / p, h), (h, f * h / p), (f * h / p, h))
        fwd_mm = bwd_mm = zero
        for k_in, k_out in linears:
            flops = 2 * m * k_in * k_out
            io = (k_in * k_out + m * (k_in + k_out)) * e
            fwd_mm = fwd_mm + kern(flops, io)
            # input gradient, weight gradient, and the weight gradient added into .grad
            bwd_mm = bwd_mm + 2 * kern(flops, io) + ew(k_in * k_out, 3)
        attn_flops = 2 * b * l * ctx * h / p
        attn_io = (b * ctx * h / p + m * h / p + scores) * e
        fwd_mm = fwd_mm + 2 * kern(attn_flops, attn_io)  # Q K^T and P V
        bwd_mm = bwd_mm + 4 * kern(attn_flops, attn_io)

        def elementwise(k):  # the block's elementwise kernels, bytes scaled by k (backward: 2)
            return (2 * ew(m * h, 2 * k)  # two layer norms
                    + 4 * ew(m * h / p, 2 * k)  # split q, k, v into heads; merge heads
                    + 2 * ew(b * ctx * h / p, 2 * k)  # concatenate cached and new K, V
                    + 3 * ew(scores, 2 * k)  # causal mask, softmax, dropout
                    + ew(m * f * h / p, 2 * k)  # GELU
                    + 2 * ew(m * h, 2 * k)  # two dropouts
                    + 2 * ew(m * h, 3 * k))  # two residual adds

        ar = TENSOR_ALLREDUCES_PER_LAYER * self._allreduce(m * h * e)
        return fwd_mm + elementwise(1) + ar, bwd_mm + elementwise(2) + ar

    def _edge_times(self, stage, l, c, b):
        """Embedding (first stage) and final norm, LM head and loss (last stage)."""
        s, p = self.shapes, self.op
        h, e, v = s.hidden, s.dtype_bytes, s.vocab
        m = l * b
        f = 0.0 * m
        bw = 0.0 * m
        if stage == 0 and s.with_embedding:
            t = self._kernel(0 * m, 2 * m * h * e)  # gather rows of the table (+ positions)
            f, bw = f + t, bw + 2 * t  # backward: scatter-add into the table's gradient
        if stage == self.num_stages - 1 and s.with_head:
            head = self._kernel(2 * m * h * v / p, (h * v / p + m * (h + v / p)) * e)
            loss = self._kernel(0 * m, 3 * m * v / p * e) + self._allreduce(m * 4 * 2)
            norm = self._kernel(0 * m, 2 * m * h * e)
            f = f + head + loss + norm
            bw = bw + 2 * head + loss + 2 * norm
        return f, bw

    # ----------------------------------------------------------------------- protocol

    def slice_times(self, stage, l, c, mb):
        l = np.asarray(l, dtype=np.float64)
        c = np.asarray(c, dtype=np.float64)
        mb = np.asarray(mb, dtype=np.float64)
        n = self.stage_layers[stage]
        lf, lb = self._layer_times(l, c, mb)
        ef, eb = self._edge_times(stage, l, c, mb)
        return n * lf + ef, n * lb + eb

    def distinct_stages(self) -> tuple[int, ...]:
        """One stage per distinct (layer count, first, last): the others cost the same."""
        seen = {}
        last = self.num_stages - 1
        for st, n in enumerate(self.stage_layers):
            seen.setdefault((n, st == 0, st == last), st)
        return tuple(sorted(seen.values()))

    def slice_time(self, stage: int, l: int, c: int, mb_size: int) -> tuple[float, float]:
        f, b = self.slice_times(stage, l, c, mb_size)
        return float(f), float(b)

    def activation_bytes(self, l: int, mb_size: int) -> int:
        return int(l * mb_size * self.shapes.hidden * self.shapes.dtype_bytes)

    def activation_bytes_array(self, l, mb):
        return np.asarray(l, dtype=np.float64) * mb * self.shapes.hidden * self.shapes.dtype_bytes

    def kv_bytes(self, stage: int, l: int, mb_size: int) -> int:
        s = self.shapes
        return int(2 * self.stage_layers[stage] * l * mb_size * s.hidden // self.op * s.dtype_bytes)

    def stash_bytes(self, stage: int, l: int, c: int, mb_size: int) -> int:
        """Activations a slice's forward keeps for its backward (no recomputation).

        Per layer 34*l*b*h + 5*heads*l*(c+l)*b bytes in fp16 with dropout (Korthikanti et al.,
        "Reducing activation recomputation", 2022), the matmul parts split `op` ways.
        """
        s = self.shapes
        per_layer = (10 * l * mb_size * s.hidden + 24 * l * mb_size * s.hidden / self.op
                     + 5 * s.heads / self.op * l * (c + l) * mb_size)
        return int(self.stage_layers[stage] * per_layer)

    def param_bytes(self, stage: int) -> int:
        s = self.shapes
        n = self.stage_layers[stage] * s.layer_params
        if stage == 0 and s.with_embedding:
            n += s.vocab * s.hidden
        if stage == self.num_stages - 1 and s.with_head:
            n += s.vocab * s.hidden + 2 * s.hidden
        return int(n // self.op * s.dtype_bytes)

    def describe(self) -> str:
        s = self.shapes
        return (f"analytic {self.device.name}: {s.layers} layers h{s.hidden} heads {s.heads} "
                f"vocab {s.vocab}, stages {self.num_stages}, op {self.op}")
