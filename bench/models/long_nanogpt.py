"""examples/nanogpt.py at long context (rows of 4096 tokens and more), narrow enough for a CPU:
what bench/documents.py trains over packed documents. A zero-argument factory, as
`tpc compile --factory NAME` needs."""

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "examples" / "nanogpt.py"
_spec = importlib.util.spec_from_file_location("bench_long_nanogpt_example", _path)
_example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _example  # dataclasses look their module up by name
_spec.loader.exec_module(_example)


def model():
    """2 layers, width 64 (2 heads of 32), positions up to 4096: attention dominates a step."""
    return _example.model(n_layer=2, n_embd=64, n_head=2, block_size=4096)


def wide():
    """8 layers, width 2048 (16 heads of 128), positions up to 8192: the plan search's example
    (compiled without weights, priced on a device model; never run on a CPU)."""
    return _example.model(n_layer=8, n_embd=2048, n_head=16, block_size=8192)
