"""A one-layer, width-16 GPT from examples/gpt.py, written as a model file for `tpc profile`."""

from __future__ import annotations

import textwrap
from pathlib import Path

L = 16  # the sequence length the tests profile it at
SIZES = (1, 3)  # the micro-batch sizes profiled (2 lies between them, 4 beyond)


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


def refusals(path: Path) -> list[str]:
    """The errors both readers of a profile (the file reader and the cost-model loader) give
    for `path`; each must refuse it."""
    import pytest

    from tpc.compiler.costmodel import load_cost_model
    from tpc.compiler.costmodel.store import load_profile
    from tpc.ir.diagnostics import TpirError

    texts = []
    for load in (lambda: load_profile(path), lambda: load_cost_model(cost=str(path), stage_units=[(0, 3)])):
        with pytest.raises(TpirError) as e:
            load()
        texts.append(str(e.value))
    return texts
