"""`DeviceCostModel`: what the cost models priced on a `DeviceSpec` share (the analytic GPT
model and the traced-graph model): the links between stages and the gradient all-reduce.

Stage s runs on GPUs [s * op, (s + 1) * op) of consecutive nodes of `gpus_per_node`; a boundary
crosses a node when its two stages sit on different nodes (or a stage fills whole nodes).
"""

from __future__ import annotations

import numpy as np

from tpc.compiler.costmodel.base import CostModel
from tpc.compiler.costmodel.devices import DeviceSpec


class DeviceCostModel(CostModel):
    device: DeviceSpec
    op: int = 1  # GPUs per stage (operator parallelism)

    def _boundary_crosses_node(self, stage: int) -> bool:
        g = self.device.gpus_per_node
        return (stage * self.op) // g != ((stage + 1) * self.op) // g or self.op >= g

    def p2p_times(self, nbytes):
        """Worst boundary: a send between nodes when any boundary crosses one.

        The `op` GPUs of a stage hold the same activation after the layer's all-reduce; each
        sends its 1/op share, so the node's link carries the activation once.
        """
        d = self.device
        nbytes = np.asarray(nbytes, dtype=np.float64)
        if any(self._boundary_crosses_node(s) for s in range(self.num_stages - 1)):
            return d.inter_node_latency + nbytes / d.inter_node_bandwidth
        return d.intra_node_latency + nbytes / d.intra_node_bandwidth

    def p2p_time(self, nbytes: int) -> float:
        return float(self.p2p_times(nbytes))

    def grad_sync_time(self, stage: int, data: int) -> float:
        """All-reduce of a stage's gradients over `data` replicas on different nodes."""
        return self.device.internode_allreduce_time(self.param_bytes(stage), data)
