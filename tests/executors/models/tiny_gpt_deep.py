"""A tiny examples/gpt.py with six blocks (eight partition units: up to eight pipeline stages),
width 16, sequences up to 16, for the tests that run 2 x 4 and 4 x 2 stage schedules."""

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[3] / "examples" / "gpt.py"
_spec = importlib.util.spec_from_file_location("tiny_gpt_deep_example", _path)
_example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _example  # dataclasses look their module up by name
_spec.loader.exec_module(_example)


def model():
    return _example.model(n_layer=6, n_embd=16, n_head=2, block_size=16)
