"""State-space layers: a selective scan's state carried from token slice to token slice.

Mamba's and Mamba-2's scans are causal recurrences: slice i needs of the tokens before it only
the state they left, of constant size (`ssm_ops.py`). Two steps make a model's scan sliceable:

* At capture (`known_scans`), the scan function of the model's code becomes one opaque op,
  `torch.ops.tpc.selective_scan` or `torch.ops.tpc.ssd_scan`. The functions are recognised by
  the kernel each names: Hugging Face marks its reference scans with the kernel that replaces them
  (`use_kernel_func_from_hub_with_fallback("selective_scan_fn", ...)`, Mamba's, in
  `modeling_mamba.py`, FalconMamba, Jamba and Zamba; `"mamba_chunk_scan_combined"`, Mamba-2's, in
  `modeling_mamba2.py`, Bamba, FalconH1, GraniteMoeHybrid, NemotronH and Zamba2), and tpc puts
  its own in their place for the capture, as that kernel hub does for a GPU. RWKV's WKV
  (`rwkv_linear_attention`) is known by its name, RecurrentGemma's RG-LRU by its method
  (`RecurrentGemmaRglru._rnn_scan`). Without this, the capture unrolls Mamba's, RWKV's and the
  RG-LRU's loops over the tokens (one iteration per token: the length is fixed) and guards
  Mamba-2's padding to a multiple of its chunk. The model runs its own code
  otherwise, and `tpc run --verify-grads` checks the plan against the model as written.
* The pass `CarryScanState` rewrites each captured scan into its carried form, which takes the
  state the slice before ended with (a new placeholder `scan_state_i`: 0 entries on axis 1 for
  the first slice, 1 after) and also returns the slice's final state. That final state is the
  site's cached tensor (`ScanSite`), one entry per slice, kept as a window of one: a later slice
  reads the last entry as a leaf that requires grad, and its gradient flows into the earlier
  slice's final state when that slice runs backward, as a KV cache's does.

A scan the front end does not know (a loop over the tokens in the model's own code) is refused
at capture, at the loop (`token_loops.py`).
"""

from __future__ import annotations

import inspect
import operator
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
import torch.nn as nn

from tpc.compiler.frontend import ssm_ops
from tpc.compiler.frontend.calls import call_args
from tpc.compiler.frontend.carried_state import fake_like
from tpc.compiler.frontend.context import PassContext
from tpc.compiler.frontend.data_independent import prune_dead
from tpc.compiler.frontend.source_locations import refuse

KIND = "ssm-scan"  # node.meta["tpc_kind"] of a carried scan and of its final state
CARRIED_OUT = "carried-out"  # a value no op of the graph reads, but a later slice does: kept
# `SlicedModel.unit_kv`'s window of a carried state: (elements of one sequence's state, STATE)
STATE = "state"


# ------------------------------------------------------------------ capture

def _mamba(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
           return_last_state=False, **_):
    if return_last_state:
        raise ValueError("a plan's model runs without a generation cache: no final state is returned")
    return torch.ops.tpc.selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias, bool(delta_softplus))


def _mamba2(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
            dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **_):
    if initial_states is not None or return_final_states:
        raise ValueError("a plan's model runs without a generation cache: no initial or final state")
    if z is not None:
        raise ValueError("Mamba-2's reference scan does not gate its output by z")
    lo, hi = dt_limit
    return torch.ops.tpc.ssd_scan(hidden_states, dt, A, B, C, D, dt_bias, bool(dt_softplus),
                                  float(lo), float(hi), int(chunk_size))


def _rwkv(time_decay, time_first, key, value, state=None, return_state=False):
    if state is not None or return_state:
        raise ValueError("a plan's model runs without a generation cache: no initial or final state")
    return torch.ops.tpc.wkv(time_decay, time_first, key, value), None


def _rg_lru(self, hidden_states, recurrent_gate, reset, recurrent_states=None, acc_dtype=torch.float32):
    if recurrent_states is not None or acc_dtype != torch.float32:
        raise ValueError("a plan's model runs without a generation cache: no initial state")
    return torch.ops.tpc.linear_scan(hidden_states, recurrent_gate * ~reset), None


# the kernel a model's scan function names -> what stands in for it at capture
KERNELS = {"selective_scan_fn": _mamba, "mamba_chunk_scan_combined": _mamba2, "wkv": _rwkv}
# Hugging Face's names of the functions, where the kernel's name cannot be read off the function
_NAMES = {"mamba_selective_scan": "selective_scan_fn", "mamba2_chunk_scan": "mamba_chunk_scan_combined",
          "rwkv_linear_attention": "wkv"}
# scans written as methods: (class, method) -> what stands in for the method at capture
METHODS = {("RecurrentGemmaRglru", "_rnn_scan"): _rg_lru}


def kernel_of(fn) -> str | None:
    """The kernel a scan function of a model's code stands for, or None."""
    if not callable(fn):
        return None
    try:
        named = inspect.getclosurevars(fn).nonlocals.get("func_name")
    except (TypeError, ValueError):
        named = None
    if named in KERNELS:
        return named
    return _NAMES.get(getattr(fn, "__name__", None)) if getattr(fn, "__module__", "").startswith("transformers.") \
        else None


@contextmanager
def known_scans(model: nn.Module):
    """For the capture: in the modules defining `model`'s classes, every scan function tpc
    knows replaced by its op (the module docstring); put back afterwards."""
    swapped = []
    for name in {type(m).__module__ for m in model.modules()}:
        mod = sys.modules.get(name)
        for attr, fn in list(vars(mod).items()) if mod is not None else ():
            kernel = kernel_of(fn)
            if kernel is not None:
                swapped.append((mod, attr, fn))
                setattr(mod, attr, KERNELS[kernel])
    for cls in {type(m) for m in model.modules()}:
        for klass in cls.__mro__:
            for (owner, method), stand_in in METHODS.items():
                if klass.__name__ == owner and klass.__module__.startswith("transformers.") and method in vars(klass):
                    swapped.append((klass, method, vars(klass)[method]))
                    setattr(klass, method, stand_in)
    try:
        yield
    finally:
        for owner, attr, fn in reversed(swapped):
            setattr(owner, attr, fn)


# ------------------------------------------------------------------ the rewrite

@dataclass
class ScanSite:
    """A scan's final state, carried from slice to slice: one entry per slice on axis 1, of
    which a later slice reads the last (a window of one entry)."""

    node: fx.Node  # the carried scan (its unit holds the state)
    final: fx.Node  # the slice's final state (batch, 1, ...)
    prefix: fx.Node  # placeholder: the state the slice before ended with (batch, 0 or 1, ...)
    window: int = 2
    per_slice = True  # (CacheSite) the cached tensor holds an entry per slice, not per token

    @property
    def cached(self) -> list[tuple]:
        return [(self.final, self.prefix, 1, self.window)]


def _val(n: fx.Node, name: str):
    return call_args(n)[name].meta["val"]


# each captured op -> (its carried form, the shape of one entry of its state)
_CARRIED = {
    # Mamba: (batch, 1, channels, state) from x (batch, channels, tokens), A (channels, state)
    torch.ops.tpc.selective_scan.default: (ssm_ops.selective_scan_carried, lambda n: (
        _val(n, "x").shape[0], 1, _val(n, "x").shape[1], _val(n, "A").shape[-1])),
    # Mamba-2: (batch, 1, heads, head_dim, state) from x (batch, tokens, heads, head_dim), B (..., state)
    torch.ops.tpc.ssd_scan.default: (ssm_ops.ssd_scan_carried, lambda n: (
        _val(n, "x").shape[0], 1, _val(n, "x").shape[2], _val(n, "x").shape[3], _val(n, "B").shape[-1])),
    # RWKV: (batch, 1, 3, channels) from key (batch, tokens, channels)
    torch.ops.tpc.wkv.default: (ssm_ops.wkv_carried, lambda n: (
        _val(n, "key").shape[0], 1, 3, _val(n, "key").shape[2])),
    # RecurrentGemma: (batch, 1, channels) from x (batch, tokens, channels)
    torch.ops.tpc.linear_scan.default: (ssm_ops.linear_scan_carried, lambda n: (
        _val(n, "x").shape[0], 1, _val(n, "x").shape[2])),
}


class CarryScanState:
    """Every captured scan runs from the state the slice before ended with (module docstring)."""

    name = "scan-state"

    def run(self, ctx: PassContext) -> PassContext:
        sites = carry_scan_state(ctx)
        return replace(ctx, states=ctx.states + tuple(sites)) if sites else ctx


def carry_scan_state(ctx: PassContext) -> list[ScanSite]:
    graph = ctx.graph
    scans = [n for n in graph.nodes if n.op == "call_function" and n.target in _CARRIED]
    if not scans:
        return []
    anchor = max((n for n in graph.nodes if n.op == "placeholder"), key=list(graph.nodes).index)
    sites = []
    for i, n in enumerate(scans):
        if n in ctx.static:
            raise refuse(n, ctx.model_file, f"a state-space scan (node {n.name}) that reads no token data",
                         "a scan runs over the model's token stream")
        carried, shape = _CARRIED[n.target]
        state = fake_like(n.meta["val"], shape(n)).float()
        with graph.inserting_after(anchor):
            prefix = graph.placeholder(f"scan_state_{i}")
        prefix.meta["val"] = state
        anchor = prefix
        with graph.inserting_before(n):
            call = graph.call_function(carried, (*n.args, prefix), dict(n.kwargs))
            y = graph.call_function(operator.getitem, (call, 0))
            final = graph.call_function(operator.getitem, (call, 1))
        call.meta = {k: v for k, v in n.meta.items() if k not in ("val", "tpc_kind")}
        call.meta["val"] = (n.meta["val"], state)
        call.meta["tpc_kind"] = KIND
        for node, val, kind in ((y, n.meta["val"], KIND), (final, state, CARRIED_OUT)):
            node.meta = {k: v for k, v in n.meta.items() if k not in ("val", "tpc_kind")}
            node.meta["val"], node.meta["tpc_kind"] = val, kind
        n.replace_all_uses_with(y)
        graph.erase_node(n)
        sites.append(ScanSite(call, final, prefix))
    prune_dead(graph)
    return sites

