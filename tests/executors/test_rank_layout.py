"""Ranks over nodes: which global ranks form a pipeline and which links cross nodes; the
torchrun environment of a multi-node run (global vs local ranks); refusals that name the nodes."""

from __future__ import annotations

import pytest
import torch

from tests.executors.real import real_plan
from tpc.executors.distributed import World, check_world
from tpc.executors.options import RunOptions
from tpc.executors.rank_layout import crossing_boundaries, describe, pipelines
from tpc.ir.mesh import Mesh
from tpc.ir.diagnostics import TpirError


def test_pipelines_are_consecutive_global_ranks():
    assert pipelines(Mesh.of(2, 3)) == [(0, 1), (2, 3), (4, 5)]


def test_a_pipeline_inside_each_node_reduces_between_nodes():
    lines = describe(Mesh.of(2, 2), [0, 0, 1, 1])
    assert lines == ["ranks: mesh pipe 2 x data 2 on 2 nodes (2, 2 processes)",
                     "  pipeline 0: global ranks 0..1 on node 0",
                     "  pipeline 1: global ranks 2..3 on node 1",
                     "  data-parallel all-reduce: between nodes"]


def test_a_pipeline_over_two_nodes_names_the_link_between_them():
    assert crossing_boundaries(Mesh.of(4, 1), [0, 0, 1, 1]) == [(0, 1)]
    lines = describe(Mesh.of(4, 1), [0, 0, 1, 1])
    assert "  pipeline links between nodes: 1->2" in lines
    assert not any("note" in line for line in lines)  # 4 > 2 processes per node: nothing better


def test_a_pipeline_that_could_fit_in_a_node_is_noted():
    # 3 stages x 2 replicas on 2 nodes of 3: pipelines 0..2 and 3..5 fit; 2 stages x 3 on 2 x 3 do not
    assert crossing_boundaries(Mesh.of(3, 2), [0, 0, 0, 1, 1, 1]) == []
    lines = describe(Mesh.of(2, 3), [0, 0, 0, 1, 1, 1])
    assert crossing_boundaries(Mesh.of(2, 3), [0, 0, 0, 1, 1, 1]) == [(1, 0)]
    assert "  pipeline links between nodes: 2->3" in lines
    assert any(line.startswith("  note: a node runs 3 processes, room for a whole pipeline of 2") for line in lines)


def test_world_from_a_multi_node_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    w = World.from_env()
    assert (w.rank, w.size, w.local_rank, w.local_size, w.node, w.nodes) == (3, 4, 1, 2, 1, 2)
    # started by hand without the local variables: one node
    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(var)
    w = World.from_env()
    assert (w.local_rank, w.local_size, w.node, w.nodes) == (3, 4, 0, 1)


def test_a_world_of_the_wrong_size_is_told_how_to_launch_on_its_nodes():
    plan = real_plan("gpt", schedule="1f1b", stages=2, dp=2, batch=4, microbatches=2, slices="1")
    with pytest.raises(TpirError) as e:
        check_world(plan, World(rank=0, size=6, local_rank=0, local_size=3, node=0))
    text = e.value.render()
    assert "needs 4 processes (mesh pipe 2 data 2), but torchrun started 6 (2 nodes x 3)" in text
    assert "torchrun --nnodes 2 --nproc-per-node 2 ...` on each node" in text


def test_a_process_beyond_its_nodes_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = RunOptions(device="cuda")
    assert cuda.torch_device(World(rank=3, size=4, local_rank=1, local_size=2, node=1).local_rank) == torch.device("cuda", 1)
    with pytest.raises(TpirError) as e:
        cuda.torch_device(World(rank=2, size=4, local_rank=2, local_size=4, node=0).local_rank)
    assert "this is process 2 of its node, which has 2 GPU(s)" in e.value.render()
