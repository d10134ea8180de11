"""A bench script loaded as a module for a test, and what loading it changes put back."""

from __future__ import annotations

import importlib.util
import sys

from tests.conftest import ROOT


def loaded(monkeypatch, script: str):
    """Yield bench/`script` as a module; sys.path and the helper module it imports (`common`) are
    put back afterwards. For a fixture: `yield from loaded(monkeypatch, "gpu_slicing.py")`."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    had_common = "common" in sys.modules
    spec = importlib.util.spec_from_file_location("bench_" + script.removesuffix(".py"), ROOT / "bench" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    if not had_common:
        sys.modules.pop("common", None)
