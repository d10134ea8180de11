"""tests/compiler/frontend/models/alibi.py `sdpa` for the executor tests: hand-written ALiBi passed
to SDPA as a float mask (the bias rebuilt per slice)."""

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "compiler" / "frontend" / "models" / "alibi.py"
_spec = importlib.util.spec_from_file_location("tiny_alibi_frontend_model", _path)
_source = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _source
_spec.loader.exec_module(_source)


def model():
    return _source.sdpa()
