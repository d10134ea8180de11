"""Building a model without (all of) its weights: on the meta device for the compile, and with
only some parameters real for a rank of a run.

`tpc compile` needs the model's code, shapes and buffers, never its weights: `build_weightless`
calls the factory (or builds the Hugging Face model) with every parameter moved to the meta device
as it is registered (`nn.Module.register_parameter`), so a 70B model is built in the memory of its
buffers. Buffers (RoPE frequencies, causal-mask tables) stay real: the front end reads them.

A rank of a run holds only its stages' parameters. `build_holding(path, factory, seed, names)`
calls the factory again after `torch.manual_seed(seed)` keeping real only the parameters `names`
(canonical names, as `named_parameters()` gives them); every other parameter lives on the meta
device, and each random draw the factory makes into one of them (`uniform_`, `normal_`, any op
torch tags `nondeterministic_seeded`) is made on a scratch CPU tensor of its shape and layout and
thrown away. So the generator advances exactly as when the whole model is built, and every kept
parameter gets, bit for bit, the value the plain model gets from the same seed. The price: each
rank draws every random number of the model (time proportional to the parameter count; memory:
the largest single parameter, briefly).

Parameters are recognised by the order they are first registered (a tie registers one tensor
twice: counted once); a factory must register them in the same order every time it runs, which
`build_holding` checks against the names.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from tpc.ir.diagnostics import Diagnostic, TpirError

META = torch.device("meta")
_CPU = torch.device("cpu")


@dataclass
class Registered:
    """The parameters a build registered, in order (each tensor once)."""

    params: list[torch.nn.Parameter]

    def index_of(self, model: nn.Module) -> dict[str, int]:
        """Canonical parameter name -> its registration index."""
        where = {id(p): i for i, p in enumerate(self.params)}
        out = {}
        for name, p in model.named_parameters():
            if id(p) in where:
                out[name] = where[id(p)]
        return out


@contextmanager
def parameters_on_meta(keep: Callable[[int], bool] = lambda i: False, draw: bool = False):
    """Within the block, a parameter registered on a module for the first time moves to the meta
    device unless `keep(its registration index)`. `draw`: random draws into meta tensors are made
    on scratch CPU tensors first (the generator advances as without this block). Yields the
    `Registered` record."""
    record = Registered([])
    seen: set[int] = set()
    orig = nn.Module.register_parameter

    def register(self, name, param):
        orig(self, name, param)
        p = self._parameters.get(name)
        if p is None or id(p) in seen:
            return
        index = len(record.params)
        if p.device != META and not keep(index):
            p = nn.Parameter(p.detach().to(META), requires_grad=p.requires_grad)
            self._parameters[name] = p
        seen.add(id(p))
        record.params.append(p)

    nn.Module.register_parameter = register
    try:
        if draw:
            with _DrawsIntoMeta():
                yield record
        else:
            yield record
    finally:
        nn.Module.register_parameter = orig


class _DrawsIntoMeta(TorchDispatchMode):
    """A seeded random op on meta tensors is first run on scratch CPU tensors of the same shapes,
    strides and dtypes, so the CPU generator advances as it would for real tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            leaves = tree_leaves((args, kwargs))
            if any(isinstance(t, torch.Tensor) and t.is_meta for t in leaves) or kwargs.get("device") == META:

                def scratch(a):
                    if isinstance(a, torch.Tensor) and a.is_meta:
                        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype)
                    return _CPU if isinstance(a, torch.device) and a == META else a

                s_args, s_kwargs = tree_map(scratch, (args, kwargs))
                func(*s_args, **s_kwargs)
                del s_args, s_kwargs
        return func(*args, **kwargs)


def build_weightless(path: str, factory: str = "model") -> tuple[nn.Module, dict[str, int]]:
    """The model of `path` with every parameter on the meta device (buffers real), and each
    canonical parameter name's registration index."""
    from tpc.compiler.frontend.model_file import load_model

    with parameters_on_meta() as record:
        model = load_model(path, factory)
    _check_all_meta(model, path)
    return model, record.index_of(model)


def _check_all_meta(model: nn.Module, path: str) -> None:
    real = [n for n, p in model.named_parameters() if p.device != META]
    if real:
        raise TpirError(Diagnostic(
            f"the model sets parameters without registering them ({', '.join(real[:3])}): tpc cannot build "
            "it without its weights", where=path,
            hint="assign parameters as module attributes (self.w = nn.Parameter(...)) or with register_parameter"))


def build_holding(path: str, factory: str, seed: int, names: Iterable[str],
                  index: dict[str, int] | None = None) -> nn.Module:
    """The model of `path` built after `torch.manual_seed(seed)` with only the parameters `names`
    real, each equal to the plain model's (module docstring); the others on the meta device.
    `index`: `build_weightless`'s name -> registration index (built here when not given)."""
    from tpc.compiler.frontend.model_file import load_model

    if index is None:
        _, index = build_weightless(path, factory)
    wanted = set(names)
    unknown = sorted(wanted - set(index))
    if unknown:
        raise ValueError(f"not parameters of the model: {', '.join(unknown[:4])}")
    keep = {index[n] for n in wanted}
    torch.manual_seed(seed)
    with parameters_on_meta(keep=keep.__contains__, draw=True) as record:
        model = load_model(path, factory)
    if record.index_of(model) != index:
        raise TpirError(Diagnostic(
            "building the model twice registered its parameters in a different order: tpc cannot build "
            "one rank's part of it", where=path,
            hint="the factory must build the same modules in the same order every time it is called"))
    from tpc.compiler.frontend.heap import release_freed_memory

    release_freed_memory()  # the scratch draws of the parameters left on meta
    return model


def holds_weights(model: nn.Module) -> bool:
    """Whether every parameter of `model` is real (none on the meta device)."""
    return all(p.device != META for p in model.parameters())


def move_real(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to(device)` for its real parameters and buffers; meta ones stay."""
    for mod in model.modules():
        for group in (mod._parameters, mod._buffers):
            for k, t in list(group.items()):
                if t is None or t.device == META or t.device == device:
                    continue
                if isinstance(t, nn.Parameter):
                    with torch.no_grad():
                        t.data = t.data.to(device)
                else:
                    group[k] = t.to(device)
    return model
