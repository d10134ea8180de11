"""examples/gpt.py without weight tying, in the sizes the benchmarks use.

torch.distributed.pipelining cannot share one parameter between two stages, so the comparison
with it (bench/vs_torch_pipelining.py) runs this untied variant in both frameworks. Each
factory is a zero-argument callable, as `tpc compile --factory NAME` needs.
"""

import importlib.util
import sys
from pathlib import Path

import torch.nn as nn

_path = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
_spec = importlib.util.spec_from_file_location("bench_gpt_example", _path)
_example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _example  # dataclasses look their module up by name
_spec.loader.exec_module(_example)


def untied(**overrides):
    """examples/gpt.py's GPT with the token embedding its own parameter (a copy of the head)."""
    m = _example.model(**overrides)
    m.transformer.wte.weight = nn.Parameter(m.lm_head.weight.detach().clone())
    return m


def model():
    """vs torch.distributed.pipelining: 8 layers (2 or 4 stages), width 128, sequences of 256."""
    return untied(n_layer=8, n_embd=128, n_head=4, block_size=256)


def wide():
    """The same at width 256 (the first measurement of docs/benchmarks.md)."""
    return untied(n_layer=8, n_embd=256, n_head=8, block_size=256)


def long():
    """Token slicing: 4 layers, width 256, sequences of up to 2048 tokens."""
    return untied(n_layer=4, n_embd=256, n_head=8, block_size=2048)


def gpt350m():
    """bench/gpu_slicing.py: GPT-2-medium's shape (24 layers, width 1024, 16 heads, GPT-2's
    vocabulary padded to 50304) with sequences of up to 2048 tokens; 355,919,872 parameters.
    The token embedding stays tied to the head, as in examples/gpt.py and GPT-2 (untied it
    would be 407,431,168): that benchmark runs only tpc, so no stage needs its own copy."""
    return _example.model(n_layer=24, n_embd=1024, n_head=16, block_size=2048, vocab_size=50304)


def gpt350m_tiny():
    """gpt350m's smoke-test stand-in: the same code paths (4 layers for 4 stages, tied
    embedding, positions up to 2048) at width 64 and a 512-token vocabulary."""
    return _example.model(n_layer=4, n_embd=64, n_head=4, block_size=2048, vocab_size=512)
