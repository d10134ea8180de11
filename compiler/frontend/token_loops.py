"""Where a model's code fixes the sequence length: a Python loop over the tokens.

A scan written as `for i in range(seq_len): state = a[:, :, i] * state + b[:, :, i]` (in a
model's own code; the scans of Hugging Face's Mamba, RWKV and RecurrentGemma are replaced at
capture by ops, `ssm_state.py`) runs as many times as there are tokens, so
torch.export records one iteration per token and specialises the sequence length to the
example's: "Constraints violated (seq)! ... You marked seq as dynamic but your code specialized
it to be a constant (14)". That tells a user nothing (14 is an example length the front end
chose, not theirs). Here the model's forward runs twice on fake tensors (no arithmetic, no
memory: `FakeTensorMode`), at 3 and at 5 tokens, counting the lines of the model's code and its
libraries' that run (not torch's, not the standard library's); the first `for` / `while` line
that runs more often with more tokens is the loop, and the refusal points at it.
"""

from __future__ import annotations

import collections
import linecache
import sys

import torch
import torch.nn as nn

from tpc.compiler.frontend.source_locations import is_model_code


def _lines_run(model: nn.Module, length: int) -> collections.Counter:
    from torch._subclasses.fake_tensor import FakeTensorMode

    counts: collections.Counter = collections.Counter()
    kinds: dict[str, bool] = {}

    def trace(frame, event, arg):
        path = frame.f_code.co_filename
        mine = kinds.get(path)
        if mine is None:
            mine = kinds[path] = is_model_code(path)
        if not mine:
            return None
        if event == "line":
            counts[(path, frame.f_lineno)] += 1
        return trace

    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
        ids = mode.from_tensor(torch.zeros(1, length, dtype=torch.long))
        old = sys.gettrace()
        sys.settrace(trace)
        try:
            model(ids)
        finally:
            sys.settrace(old)
    return counts


def token_loop(model: nn.Module) -> tuple[str, int] | None:
    """(file, line) of the first loop statement of the model's code that runs once more per
    token, or None (none found, or the model does not run on fake tensors)."""
    import logging

    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs an op's failure on fakes
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        short, long = _lines_run(model, 3), _lines_run(model, 5)
    except Exception:  # noqa: BLE001 - a model that does not run so has no loop to point at
        return None
    finally:
        quiet.setLevel(level)
    for key, n in long.items():  # first run first: dicts keep insertion order
        if n > short.get(key, 0) and linecache.getline(*key).lstrip().startswith(("for ", "while ")):
            return key
    return None
