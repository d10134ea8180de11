"""Shared test fixtures. Tests run on CPU with fp32; multi-rank tests use gloo, one thread per rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite is the CPU's (CI has no GPU). On a machine with GPUs they are hidden from the tests
# and from the ranks the tests start, so that `--device auto` means the CPU and gloo everywhere
# (two ranks of a node would otherwise ask for two GPUs). The GPU's own checks are
# bench/gpu_checks.py; TPC_TEST_CUDA=1 leaves the GPUs visible.
if os.environ.get("TPC_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    return ROOT / "examples"
