"""Plans for the real example models (tests/executors/models/tiny_*.py), traced once per file.

`compile_plan` traces the model on every call; the product of schedules x stages x slices x
micro-batches would trace it a hundred times. Here the model is loaded and traced once, and each
plan is built from the same header builder, schedule builders and lowering as `tpc compile`.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import torch

from tpc.cli.compile import check_options
from tpc.compiler.header import build_header
from tpc.compiler.frontend import read_vocab
from tpc.compiler.frontend import SlicedModel, file_sha256
from tpc.compiler.lowering.lower import lower
from tpc.compiler.lowering.recompute import apply as apply_recompute
from tpc.compiler.lowering.recompute import uniform
from tpc.compiler.schedules import build_schedule, placement_of
from tpc.compiler.schedules.placement import PLACEMENTS, place
from tpc.executors.plan_model import load_plan_model
from tpc.ir.nodes import Plan

MODELS = Path(__file__).resolve().parent / "models"


def model_file(name: str) -> str:
    return str(MODELS / f"tiny_{name}.py")


@lru_cache(maxsize=None)
def traced(path: str, seq_len: int):
    """(model with the weights of seed 0, its SlicedModel, vocabulary)."""
    from tpc.compiler.frontend import load_model

    torch.manual_seed(0)
    model = load_model(path, "model")
    vocab = read_vocab(model, path)
    return model, SlicedModel.from_model(model, seq_len=seq_len, vocab=vocab), vocab


def real_plan(name: str, *, stages: int, microbatches: int, slices: str, schedule: str, seq_len: int = 16,
              batch: int = 4, dp: int = 1, path: str | None = None, ranks: int | None = None,
              recompute: str | dict = "none", tensor: int = 1, sequence: bool = False,
              overlap: bool = False) -> Plan:
    """A verified plan for tiny_NAME.py (or the model file `path`). `ranks`: put the stages on
    that many pipeline ranks in the schedule's placement (several chunks per rank); `recompute`:
    'none', 'full', or a choice per stage; `tensor`: each stage split over that many tensor
    ranks (the mesh's tensor axis, format version 4); `sequence`: with sequence parallelism;
    `overlap`: the forwards of slice pairs brought together (`--tensor-overlap`)."""
    path = path or model_file(name)
    model, sliced, vocab = traced(path, seq_len)
    opts = check_options(stages=str(stages), microbatches=microbatches, seq_len=seq_len, batch=batch,
                         slices=slices, schedule=schedule, dp=dp, ranks=None, tensor=tensor,
                         sequence_parallel=sequence, tensor_overlap=overlap)
    ranges = [tuple(r) for r in sliced.partition_by_params(stages)]
    header = build_header(model_path=path, sha256=file_sha256(path), factory="model", opts=opts, vocab=vocab,
                          unit_labels=sliced.unit_labels, ranges=ranges, ties=sliced.ties(ranges))
    if ranks is not None and ranks != stages:
        header = place(header, PLACEMENTS[placement_of(schedule)](stages, ranks))
    compute = build_schedule(schedule, header)
    choice = uniform(header, recompute) if isinstance(recompute, str) else recompute
    return lower(header, apply_recompute(compute, choice), pairs=overlap)


def fresh_model(name: str, seq_len: int = 16):
    """A copy of the traced model's initial weights (what `tpc run --seed 0` builds), and its SlicedModel."""
    model, sliced, _ = traced(model_file(name), seq_len)
    return copy.deepcopy(model), sliced


def initial_model(name: str, seq_len: int = 16):
    """The model as the executors build it from the file (seed 0): must equal `fresh_model`."""
    return load_plan_model(real_plan(name, stages=1, microbatches=1, slices="1", schedule="gpipe",
                                     seq_len=seq_len), 0)
