"""Loading a model file: import it under a unique module name and call its factory (or build
the model a Hugging Face `config.json` describes, see `hf.py`).

Every way this can go wrong is the user's to fix, so each is a located `TpirError`: the file is
missing, does not parse, has no such callable, the callable raises, or returns no `nn.Module`.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import inspect
import itertools
import os
import sys

import torch.nn as nn

from tpc.compiler.frontend.hf import causal_lm_from_config, is_config_file, model_out_of_memory, out_of_memory
from tpc.compiler.frontend.source_locations import loc_at, loc_from_traceback
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Loc

_counter = itertools.count()


def file_sha256(path: str) -> str:
    """Hex SHA-256 of the file's bytes (plans record it so `tpc run` can refuse a changed model)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def import_model_file(path: str):
    """Import `path` as a fresh module (a unique name, so two files called model.py never clash)."""
    if not os.path.isfile(path):
        raise TpirError(Diagnostic(f"no such model file: {path}",
                                   hint="give the path of a Python file that defines `model()`"))
    name = f"tpc_model_{next(_counter)}_{os.path.splitext(os.path.basename(path))[0]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses and pickling look the module up by name while it executes
    sys.modules[name] = module
    # a model file may import helpers that sit beside it
    folder = os.path.dirname(os.path.abspath(path))
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(name, None)
        loc = Loc(path, e.lineno or 1, e.offset or 1)
        raise TpirError(Diagnostic(f"syntax error in model file: {e.msg}", loc=loc,
                                   hint="fix the Python syntax at the caret")) from None
    except Exception as e:
        sys.modules.pop(name, None)
        loc = loc_from_traceback(e.__traceback__, path) or Loc(path, 1, 1)
        raise TpirError(Diagnostic(f"importing the model file raised {type(e).__name__}: {e}", loc=loc,
                                   hint="the file must import cleanly; fix the error at this line")) from None
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    return module


def load_model(path: str, factory: str = "model") -> nn.Module:
    """Import the model file and return `factory()`, which must be an `nn.Module`. A Hugging
    Face `config.json` is built with `AutoModelForCausalLM.from_config` instead (`hf.py`;
    `factory` is not used)."""
    if is_config_file(path):
        if not os.path.isfile(path):
            raise TpirError(Diagnostic(f"no such model configuration: {path}",
                                       hint="give the path of a Hugging Face config.json or of a Python model file"))
        return causal_lm_from_config(path)
    module = import_model_file(path)
    fn = getattr(module, factory, None)
    if fn is None or not callable(fn):
        found = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        listing = ", ".join(found) if found else "none"
        raise TpirError(Diagnostic(
            f"model file defines no callable named `{factory}`", loc=Loc(path, 1, 1),
            hint=f"define `def {factory}(): return MyModel(...)` or pass --factory NAME; callables found: {listing}"))
    try:
        net = fn()
    except Exception as e:
        loc = loc_from_traceback(e.__traceback__, path) or _def_loc(fn, path)
        if out_of_memory(e):
            raise model_out_of_memory(e, loc) from None
        raise TpirError(Diagnostic(f"`{factory}()` raised {type(e).__name__}: {e}", loc=loc,
                                   hint=f"`{factory}` is called with no arguments and must build the model")) from None
    if not isinstance(net, nn.Module):
        raise TpirError(Diagnostic(
            f"`{factory}()` returned {type(net).__name__}, not a torch.nn.Module", loc=_def_loc(fn, path),
            hint=f"return the model itself, e.g. `def {factory}(): return GPT(GPTConfig())`"))
    return net


# the factory a plan's model line names when the plan was compiled from a model object in
# Python (`tpc.compile(model, ...)`): its path is the file of the model's class, and `tpc run`
# cannot build it (the library runs such a plan with the object: `tpc.pipeline(plan, model)`)
MODEL_OBJECT = "<object>"


def with_forward(model: nn.Module, forward) -> nn.Module:
    """`model` as tpc captures it, through `forward(model, ids) -> logits (B, T, V)`: a shallow
    copy sharing every parameter, buffer and submodule (so the same names), whose own `forward`
    calls `forward` on the original. For a model whose `forward` does not return the logits of
    every position from the ids alone (nanoGPT's GPT returns the last position's unless given
    targets: `with_forward(gpt, lambda m, ids: m(ids, ids)[0])`)."""
    base = type(model)

    def adapted(self, ids):
        return forward(model, ids)

    view = copy.copy(model)
    view.__class__ = type(base.__name__, (base,), {
        "forward": adapted, "__module__": base.__module__, "__qualname__": base.__qualname__})
    return view


def model_source(model: nn.Module) -> str:
    """The file of `model`'s class (what a plan compiled from the object names on its model line)."""
    cls = type(model)
    for klass in cls.__mro__:
        try:
            path = inspect.getsourcefile(klass)
        except TypeError:
            continue
        if path and os.path.isfile(path) and "torch/nn/modules" not in path.replace(os.sep, "/"):
            return path
    raise TpirError(Diagnostic(f"the source file of {cls.__qualname__} is not known",
                               hint="define the model's class in a Python file"))


def _def_loc(fn, path: str) -> Loc:
    try:
        return loc_at(path, inspect.getsourcelines(fn)[1])
    except (OSError, TypeError):
        return Loc(path, 1, 1)


def read_vocab(model, model_path: str) -> int:
    """The vocabulary: the last dimension of the logits of a tiny (1, 2) forward."""
    import torch

    try:
        with torch.no_grad():
            out = model(torch.zeros((1, 2), dtype=torch.long))
    except Exception as e:
        raise TpirError(
            Diagnostic(
                f"the model failed on a (1, 2) batch of token ids: {type(e).__name__}: {e}",
                where=model_path,
                hint="the model must take a (batch, seq) LongTensor of token ids and return logits",
            )
        ) from None
    logits = logits_of(out)
    if logits is None or logits.dim() != 3 or tuple(logits.shape[:2]) != (1, 2):
        shape = tuple(logits.shape) if logits is not None else type(out).__name__
        raise TpirError(
            Diagnostic(
                f"the model's output for a (1, 2) input is {shape}, not logits of shape (1, 2, vocab)",
                where=model_path,
                hint="return the logits (batch, seq, vocab) from forward; the loss is added by tpc",
            )
        )
    return int(logits.shape[-1])


def logits_of(out):
    """The logits in what a model returns: the tensor itself, a dict's or an output object's
    "logits", or a tuple's first entry (None when there are none)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return logits_of(out.get("logits"))
    if isinstance(out, (tuple, list)) and out:
        return logits_of(out[0])
    if hasattr(out, "logits"):
        return logits_of(out.logits)
    return None
