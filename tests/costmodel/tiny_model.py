"""A one-layer, width-16 GPT from examples/gpt.py, written as a model file for `tpc profile`."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_tiny_gpt(path: Path, repo_root: Path) -> Path:
    path.write_text(textwrap.dedent(f"""
        import importlib.util
        import sys
        _spec = importlib.util.spec_from_file_location("_gpt", {str(repo_root / 'examples' / 'gpt.py')!r})
        _gpt = importlib.util.module_from_spec(_spec)
        sys.modules["_gpt"] = _gpt  # dataclasses look their module up while the file runs
        _spec.loader.exec_module(_gpt)

        def model():
            return _gpt.model(n_layer=1, n_embd=16, n_head=2, block_size=16)
    """))
    return path
