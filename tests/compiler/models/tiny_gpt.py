"""A tiny GPT for compile tests: examples/gpt.py with two layers and a narrow residual stream."""

import importlib.util
import os
import sys

_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "gpt.py")
_spec = importlib.util.spec_from_file_location("tpc_tests_example_gpt", _EXAMPLE)
_gpt = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _gpt  # dataclasses look their module up while it executes
_spec.loader.exec_module(_gpt)


def model():
    return _gpt.model(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=64)
