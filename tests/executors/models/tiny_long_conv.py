"""tests/compiler/frontend/models/short_conv.py `long_kernel` for the executor tests: Mamba-style
causal convolutions of kernel 7 (a slice of one token reads the last 6, spanning several earlier
slices)."""

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "compiler" / "frontend" / "models" / "short_conv.py"
_spec = importlib.util.spec_from_file_location("tiny_long_conv_frontend_model", _path)
_source = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _source
_spec.loader.exec_module(_source)


def model():
    return _source.long_kernel()
