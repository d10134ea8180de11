"""A tiny examples/gpt.py without biases (2 layers, width 32, sequences up to 32), for the tests
that compare weights and AdamW state with plain PyTorch element by element after several steps.

With biases, the key projection's bias has a gradient that is zero in exact arithmetic (softmax
does not change when a constant is added to every score of a row), so what autograd returns is
rounding noise, different for every order of summation; AdamW divides by the running norm of
that noise and moves the bias by about the learning rate in a direction the noise picks. Any
two correct implementations then disagree there, so such a parameter cannot be compared.
"""

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[3] / "examples" / "gpt.py"
_spec = importlib.util.spec_from_file_location("tiny_gpt_nobias_example", _path)
_example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _example  # dataclasses look their module up by name
_spec.loader.exec_module(_example)


def model():
    return _example.model(n_layer=2, n_embd=32, n_head=2, block_size=32, bias=False)
