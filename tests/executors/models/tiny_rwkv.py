"""tests/compiler/frontend/models/token_shift.py `model` for the executor tests: RWKV-style token
shift (the previous token carried from slice to slice)."""

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "compiler" / "frontend" / "models" / "token_shift.py"
_spec = importlib.util.spec_from_file_location("tiny_rwkv_frontend_model", _path)
_source = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _source
_spec.loader.exec_module(_source)


def model():
    return _source.model()
