"""tiny_gpt.py with dropout 0.2 (embeddings, attention, MLP): training draws masks, evaluation
(`model.eval()`, and the plan's evaluation program) runs without them."""

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[3] / "examples" / "gpt.py"
_spec = importlib.util.spec_from_file_location("tiny_gpt_dropout_example", _path)
_example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _example  # dataclasses look their module up by name
_spec.loader.exec_module(_example)


def model():
    return _example.model(n_layer=2, n_embd=32, n_head=2, block_size=32, dropout=0.2)
