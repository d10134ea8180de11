"""A tiny examples/gpt.py (2 layers, width 32, sequences up to 32) for the executor tests."""

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[3] / "examples" / "gpt.py"
_spec = importlib.util.spec_from_file_location("tiny_gpt_example", _path)
_example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _example  # dataclasses look their module up by name
_spec.loader.exec_module(_example)


def model():
    return _example.model(n_layer=2, n_embd=32, n_head=2, block_size=32)
