"""A rank's place on the mesh's tensor axis, for both executors (issue #34).

A plan whose mesh has a tensor axis (`mesh pipe P data D tensor T`) runs each pipeline rank's
stream on T processes (or, in the interpreter, T threads) at once, each holding its part of the
stages' weights (`compiler/tensor/`: the split is found from the stage's graph when the stage is
built). `TensorRank` is what one of them needs beyond an ordinary rank:

- `group`, the `TensorGroup` its stages' collectives run over (a torch.distributed group under
  torchrun, a `ThreadGroup` in the interpreter);
- `held`, its parts of the parameters by name: every stage it builds (its other stages, the
  evaluation's stages, the stages of another plan of a bundle) takes the same Parameter, so a
  tie on one rank is one tensor and the optimizer sees each part once;
- `shards`, every parameter's `ParamShard` (how the full tensor is cut): the gradient check, the
  gradients and weights an interpreted run returns, the clipping norm and the checkpoints read
  it to put parts together or to count a replicated parameter once.

`tensor_stage_factory` is the stage factory of such a rank. What it does not run is refused
before any work (`check_tensor_run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan


@dataclass
class TensorRank:
    """Tensor rank `rank` of `degree` (the module docstring)."""

    degree: int
    rank: int
    group: object  # a compiler.tensor TensorGroup
    sequence: bool = False  # `sequence-parallel`: activations between regions split over the tokens
    held: dict = field(default_factory=dict)  # name -> this rank's part (a Parameter)
    shards: dict = field(default_factory=dict)  # name -> ParamShard, of every stage built

    @staticmethod
    def of(mesh, t: int, group) -> "TensorRank | None":
        """Tensor rank `t` of the plan's mesh line `mesh` (`ir.nodes.MeshLine`) over `group`;
        None without a tensor axis."""
        return TensorRank(mesh.tensor, t, group, sequence=mesh.sequence) if mesh.tensor > 1 else None

    def split(self, name: str):
        """The `ParamShard` of parameter `name` when it is cut over the ranks, else None
        (replicated: every tensor rank holds it whole)."""
        shard = self.shards.get(name)
        return None if shard is None or shard.replicated else shard

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the tensor group (no gradient): the same on every rank."""
        return self.group.all_reduce(t)

    def replicated_names(self, names) -> set[str]:
        """Of `names`, those every tensor rank holds whole: counted once (by tensor rank 0)
        where a sum over the ranks must see each element once."""
        return {n for n in names if self.split(n) is None}


def tensor_stage_factory(sliced, model_copy: torch.nn.Module, tensor: TensorRank, evaluation: bool = False,
                         programs=None):
    """The StageFactory of tensor rank `tensor`: each stage the rank's part of units [lo, hi)
    (`compiler.tensor.shard_stage`), its parameters cut from `model_copy`'s (the rank's copy of
    the model) and shared through `tensor.held`; run eagerly under autograd, or, where
    `programs(stage)` says how (`engine.programs_for`: a split backward, --compile), through the
    programs traced from the rank's graph, its collectives nodes of their own."""
    from tpc.compiler.programs.stage_programs import StagePrograms
    from tpc.compiler.tensor.shard import shard_stage
    from tpc.executors.engine import BuiltStage
    from tpc.executors.stage_runtime import StageRuntime

    def build(stage, loss_scale: float) -> BuiltStage:
        lo, hi = stage.units
        module = shard_stage(sliced, lo, hi, tensor.degree, tensor.rank, tensor.group, params_from=model_copy,
                             evaluation=evaluation, held=tensor.held, sequence=tensor.sequence)
        tensor.shards.update(module.shards)
        release_whole(model_copy, tensor.held)
        how = programs(stage) if programs is not None else None
        return BuiltStage(StageRuntime(module, loss_scale, None if how is None else StagePrograms(module, how)),
                          list(module.named_parameters()))

    return build


def release_whole(model_copy: torch.nn.Module | None, held: dict) -> None:
    """Drop the whole tensors of `model_copy`'s parameters the rank now holds its parts of:
    a rank keeps 1/T of a split weight, not the whole one it was cut from. The copy's
    parameters stay (empty), so its names still say what the model has."""
    if model_copy is None:
        return
    for name, p in model_copy.named_parameters():
        if name in held and p is not held[name] and p.numel():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def check_tensor_run(plan: Plan, options, by: str) -> None:
    """Refuse, before any work, what a tensor axis does not run: `--shard-optimizer`, whose
    checkpoints would cut a tensor part into flat ranges."""
    mesh = plan.header.mesh
    if mesh.tensor == 1:
        return
    where = dict(loc=mesh.loc, where=plan.source)
    if getattr(options, "shard_optimizer", False) and mesh.data > 1:
        raise TpirError(Diagnostic(
            f"{by}: --shard-optimizer with a tensor axis (mesh {mesh.sizes}) is not built", **where,
            hint="drop --shard-optimizer: each tensor rank already keeps 1/T of a split weight's "
                 "optimizer state"))


def held_bytes(engine) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) a rank's engine holds: every tensor of its
    stages' parameters once (a tie on the rank once, a tensor rank's part at its size) and the
    tensors of their optimizer state."""
    seen: set[int] = set()
    params = optim = 0
    for _, p in engine.named_parameters:
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += p.numel() * p.element_size()
        state = engine.optimizer.state_of(p) if engine.optimizer is not None and engine.optimizer.optimizes(p) else None
        for v in (state or {}).values():
            if isinstance(v, torch.Tensor):
                optim += v.numel() * v.element_size()
    return params, optim
