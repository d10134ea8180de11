"""What the front end's passes share: `PassContext`, and `Pass`, the shape of each pass.

The capture makes the context: the graph and the facts every pass reads (the ids, the batch and
sequence symbols, the plan's length, how to fetch a parameter or buffer). Each pass is a small
named object whose `run(ctx)` reads the context and returns it with what the pass produced
(`dataclasses.replace`: the attention sites, the carried state, the units, ...); `sliced.py`
runs them in one loop, linting the graph and recomputing which values are static after each.

The graph is the one thing a pass changes in place (fx graph surgery); the context itself is
frozen. What a pass finds out about a single node stays in `node.meta` (`tpc_kind`, `tpc_cost`),
as torch.fx keeps analysis results.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Callable, ClassVar, Mapping, Protocol

import sympy
import torch
import torch.fx as fx

from tpc.compiler.frontend.data_independent import static_nodes
from tpc.compiler.frontend.partition import Unit


class CacheSite(Protocol):
    """A place of the graph that caches tensors across token slices: an attention's keys and
    values (`attention.AttentionSite`) or a causal mixer's carried input
    (`carried_state.StateSite`)."""

    node: fx.Node  # the op that reads the cache (its unit holds the cache)
    window: int | None  # a later slice reads only the last window - 1 tokens; None: all of them
    per_slice: bool  # its cached tensor holds an entry per slice (a scan's state), not per token

    @property
    def cached(self) -> list[tuple[fx.Node, fx.Node, int, int | None]]:
        """(this slice's value, prefix placeholder, token axis, window) of each cached tensor."""
        ...


@dataclass(frozen=True)
class PassContext:
    """The rewritten graph and what the passes found, at one point of the pipeline."""

    # ---- made by the capture, the same for every pass
    graph: fx.Graph  # rewritten in place by the passes
    ids: fx.Node  # the token ids placeholder
    offset: fx.Node  # the slice's first token (a placeholder holding an int)
    batch_sym: sympy.Symbol
    seq_sym: sympy.Symbol
    seq_len: int  # the plan's length: masks are read, full-length positions computed, at it
    vocab: int
    model_name: str  # the model's class, where a refusal has no source line
    model_file: str | None  # the file a refusal points into
    read_attr: Callable[[str], object]  # a parameter, buffer or capture constant by its graph name
    param_names: frozenset[str]
    # ---- produced by the passes (empty until the pass that makes it has run)
    static: frozenset[fx.Node] = frozenset()  # values that never depend on the token data
    logits: fx.Node | None = None  # the value the model returns (`CheckLogits`)
    attention: tuple[CacheSite, ...] = ()  # attention sites, graph order (`SliceAttention`)
    states: tuple[CacheSite, ...] = ()  # carried causal state, graph order (`CarryCausalState`)
    constants: Mapping[str, torch.Tensor] = field(default_factory=lambda: MappingProxyType({}))  # bias tables
    units: tuple[Unit, ...] = ()  # partition units, graph order (`CutUnits`)

    def fetch(self, name: str):
        """The value of a `get_attr` target of the rewritten graph."""
        if name in self.constants:
            return self.constants[name]
        return self.read_attr(name)

    @property
    def prefixes(self) -> frozenset[fx.Node]:
        """The placeholders of the tokens cached by earlier slices (attention K/V, carried state)."""
        return frozenset(prefix for s in (*self.attention, *self.states) for _, prefix, _, _ in s.cached)

    @property
    def data_inputs(self) -> frozenset[fx.Node]:
        """The placeholders that carry token data: the ids and every cached prefix."""
        return self.prefixes | {self.ids}

    def with_static(self) -> PassContext:
        """This context with `static` recomputed for the graph as it is now."""
        return replace(self, static=frozenset(static_nodes(self.graph, self.batch_sym, self.seq_sym,
                                                           set(self.data_inputs))))

    @property
    def data_nodes(self) -> list[fx.Node]:
        """The values that depend on the token data, the ids among them, in graph order (the cached
        prefixes aside: a stage makes its own)."""
        prefixes = self.prefixes
        return [n for n in self.graph.nodes if n not in self.static and n.op != "output" and n not in prefixes]

    @cached_property
    def cache_sites(self) -> tuple[CacheSite, ...]:
        """Every site that caches tensors across slices (attention and carried state), in graph
        order: the order of a stage's cached inputs and outputs."""
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        return tuple(sorted((*self.attention, *self.states), key=lambda s: order[s.node]))

    @cached_property
    def site_units(self) -> tuple[int, ...]:
        """The unit holding each of `cache_sites`."""
        unit_of = {n: i for i, u in enumerate(self.units) for n in u.nodes}
        return tuple(unit_of[s.node] for s in self.cache_sites)


class Pass(Protocol):
    """One step of the front end: `run` reads the context and returns it with what it made."""

    name: ClassVar[str]

    def run(self, ctx: PassContext) -> PassContext: ...
