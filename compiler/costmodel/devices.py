"""Accelerator and cluster specifications for the analytic cost model.

A `DeviceSpec` is a handful of public numbers about one GPU and the links around it. The
presets quote vendor data sheets (peak dense fp16/bf16 tensor FLOP/s, HBM bandwidth) and the
fabric of the usual cloud node; the achieved fractions are deliberately the same for every
preset (what large fp16 GEMMs and streaming kernels reach in an eager PyTorch training step),
so that no preset is tuned to a result. A spec can also come from a small JSON file with the
same field names, for a machine the presets do not describe.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tpc.ir.diagnostics import Diagnostic, TpirError

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    # dense fp16/bf16 tensor-core peak of one GPU (FLOP/s)
    peak_flops: float
    # HBM bandwidth of one GPU (bytes/s)
    mem_bandwidth: float
    # fraction of peak FLOP/s a large GEMM reaches inside a training step (cuBLAS + framework)
    flops_efficiency: float = 0.6
    # fraction of HBM bandwidth a streaming (elementwise, weight-read) kernel reaches
    mem_efficiency: float = 0.8
    # fixed cost of one kernel on the GPU: the launch and the gap to the next kernel (s)
    launch_overhead: float = 10e-6
    # host time to issue one kernel of a training step in eager PyTorch through tpc's stage
    # runtime (s), per kernel the traced graph counts: autograd, autocast and the dispatcher.
    # The host runs ahead of the GPU, so a stage's slice takes the longer of its kernels' GPU
    # time and kernels * host_op_time (graph.py; the hand-written GPT block of analytic.py does
    # not apply it). 0: the host never holds the GPU back (the published systems the V100/A100
    # presets reproduce).
    host_op_time: float = 0.0
    # GPUs in one node, joined by NVLink/NVSwitch
    gpus_per_node: int = 8
    # NCCL all-reduce bus bandwidth inside a node (bytes/s)
    intra_node_bandwidth: float = 130 * GB
    # the node's network bandwidth to other nodes (bytes/s), shared by its GPUs
    inter_node_bandwidth: float = 25e9 / 8
    # one message's fixed latency inside a node and between nodes (s)
    intra_node_latency: float = 10e-6
    inter_node_latency: float = 30e-6
    # fraction of the node's network line rate that an all-reduce across nodes reaches. NCCL
    # on AWS networks reports 50-60 Gbit/s on a 100 Gbit/s link at 8-32 nodes (NVIDIA/nccl
    # issue 235): rings across nodes pay per-step latency and their flows contend on the NIC.
    # Point-to-point sends keep the line rate (one flow, no ring).
    collective_efficiency: float = 0.6
    # HBM capacity of one GPU (bytes)
    memory: float = 32 * GB

    def __post_init__(self):
        positive = ("peak_flops", "mem_bandwidth", "flops_efficiency", "mem_efficiency",
                    "intra_node_bandwidth", "inter_node_bandwidth", "collective_efficiency",
                    "memory")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"device spec: {name} must be > 0")
        if not (0 < self.flops_efficiency <= 1 and 0 < self.mem_efficiency <= 1
                and 0 < self.collective_efficiency <= 1):
            raise ValueError("device spec: efficiencies must be in (0, 1]")
        if self.gpus_per_node < 1:
            raise ValueError("device spec: gpus_per_node must be >= 1")
        if min(self.launch_overhead, self.host_op_time, self.intra_node_latency, self.inter_node_latency) < 0:
            raise ValueError("device spec: latencies must be >= 0")

    def group_allreduce_time(self, nbytes, ranks: int):
        """Ring all-reduce of `nbytes` (a number or an array) over the `ranks` GPUs of one
        tensor-parallel group: on the node's NVLink when the group fits in a node, else across
        nodes at `collective_efficiency` of their link. 0 for one rank. The analytic GPT model's
        all-reduces and the traced-graph model's tensor collectives (graph.py) are this one
        formula."""
        if ranks <= 1:
            return 0.0 * nbytes
        inside = ranks <= self.gpus_per_node
        bw = self.intra_node_bandwidth if inside else self.inter_node_bandwidth * self.collective_efficiency
        lat = self.intra_node_latency if inside else self.inter_node_latency
        return self.launch_overhead + 2 * (ranks - 1) * lat + 2 * (ranks - 1) / ranks * nbytes / bw

    def internode_allreduce_time(self, nbytes: float, data: int) -> float:
        """Ring all-reduce of `nbytes` on each GPU over `data` replicas on different nodes.

        Every GPU of a node syncs its own shard at the same moment, so the node's link carries
        `gpus_per_node` rings at once, at `collective_efficiency` of its line rate.
        """
        if data <= 1:
            return 0.0
        bw = self.inter_node_bandwidth * self.collective_efficiency
        return (2 * (data - 1) * self.inter_node_latency
                + 2 * (data - 1) / data * nbytes * self.gpus_per_node / bw)


# AWS p3.16xlarge: 8 V100-SXM2 16GB (NVLink hybrid cube mesh), 25 Gbit/s Ethernet between nodes.
V100 = DeviceSpec(name="v100", peak_flops=125e12, mem_bandwidth=900 * GB, memory=16 * GB,
                  intra_node_bandwidth=130 * GB, inter_node_bandwidth=25e9 / 8)
# p4d.24xlarge: 8 A100-SXM4 40GB (NVSwitch), 4 x 100 Gbit/s EFA.
A100 = DeviceSpec(name="a100", peak_flops=312e12, mem_bandwidth=1555 * GB, memory=40 * GB,
                  intra_node_bandwidth=230 * GB, inter_node_bandwidth=400e9 / 8)
# Host time per kernel (per kernel the traced graph counts, compiler/frontend/flops.py) measured
# on an H200 machine, 2026-11-27: bench/gpu_slicing.py's gpt350m (bf16 autocast, torch 2.11)
# took 58-68 us per counted kernel in each of its 4 stages, with 1 slice of 2048 tokens and with
# 8 of 256 (docs/benchmarks.md, "GPU: the first run"). The H100 machines run the same software.
HOPPER_HOST_OP_TIME = 60e-6
# p5.48xlarge: 8 H100-SXM (NVSwitch), 32 x 100 Gbit/s EFA.
H100 = DeviceSpec(name="h100", peak_flops=989e12, mem_bandwidth=3350 * GB, memory=80 * GB,
                  intra_node_bandwidth=450 * GB, inter_node_bandwidth=3200e9 / 8,
                  host_op_time=HOPPER_HOST_OP_TIME)
# p5e.48xlarge: 8 H200 (NVSwitch), 32 x 100 Gbit/s EFA.
H200 = DeviceSpec(name="h200", peak_flops=989e12, mem_bandwidth=4800 * GB, memory=141 * GB,
                  intra_node_bandwidth=450 * GB, inter_node_bandwidth=3200e9 / 8,
                  host_op_time=HOPPER_HOST_OP_TIME)

PRESETS: dict[str, DeviceSpec] = {d.name: d for d in (V100, A100, H100, H200)}


def load_device_spec(name_or_path: str) -> DeviceSpec:
    """A preset by name (v100|a100|h100|h200) or a JSON spec file with DeviceSpec's fields."""
    key = name_or_path.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if not path.is_file():
        raise TpirError(Diagnostic(
            f"unknown device model {name_or_path!r}",
            hint=f"use one of {', '.join(sorted(PRESETS))}, or the path of a JSON file with "
                 "the fields peak_flops and mem_bandwidth (and optionally "
                 + ", ".join(f.name for f in dataclasses.fields(DeviceSpec)[3:]) + ")"))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TpirError(Diagnostic(f"cannot read device spec {path}: {e}", where=str(path),
                                   hint="write a JSON object such as "
                                        '{"name": "mygpu", "peak_flops": 1e14, "mem_bandwidth": 1e12}'))
    return device_spec_from_dict(data, where=str(path))


def device_spec_from_dict(data: object, where: str = "<spec>") -> DeviceSpec:
    known = {f.name for f in dataclasses.fields(DeviceSpec)}
    if not isinstance(data, dict):
        raise TpirError(Diagnostic("a device spec must be a JSON object", where=where,
                                   hint='e.g. {"name": "mygpu", "peak_flops": 1e14, "mem_bandwidth": 1e12}'))
    unknown = sorted(set(data) - known)
    if unknown:
        raise TpirError(Diagnostic(f"unknown device spec field(s): {', '.join(unknown)}", where=where,
                                   hint=f"the fields are: {', '.join(sorted(known))}"))
    missing = [k for k in ("peak_flops", "mem_bandwidth") if k not in data]
    if missing:
        raise TpirError(Diagnostic(f"device spec lacks {', '.join(missing)}", where=where,
                                   hint="give peak FLOP/s and memory bandwidth in bytes/s"))
    fields = dict(data)
    fields.setdefault("name", Path(where).stem or "custom")
    try:
        return DeviceSpec(**fields)
    except (TypeError, ValueError) as e:
        raise TpirError(Diagnostic(f"bad device spec: {e}", where=where,
                                   hint="numbers must be positive; efficiencies in (0, 1]"))
