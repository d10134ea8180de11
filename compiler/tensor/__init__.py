"""Tensor parallelism found from the captured graph (issue #34): `split.py` finds the Megatron
split of a stage graph for a tensor degree T, `shard.py` rewrites the graph into the graph one
tensor rank runs, `collectives.py` holds the collectives (with their backward) over a
`TensorGroup`. docs/parallelism.md says what is split and what is refused."""

from tpc.compiler.tensor.collectives import DistGroup, TensorGroup, ThreadGroup, thread_groups
from tpc.compiler.tensor.shard import ParamShard, TensorStage, shard_graph, shard_stage
from tpc.compiler.tensor.split import Split, SplitPlan, find_split

__all__ = ["DistGroup", "ParamShard", "Split", "SplitPlan", "TensorGroup", "TensorStage", "ThreadGroup",
           "find_split", "shard_graph", "shard_stage", "thread_groups"]
