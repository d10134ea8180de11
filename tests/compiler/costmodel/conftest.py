"""The tiny model's profile, measured once for every test module that reads one."""

from __future__ import annotations

import pytest

from tests.compiler.costmodel.tiny_model import L, SIZES, write_tiny_gpt
from tpc.executors.profile import device_name, profile_model
from tpc.compiler.costmodel.store import load_profile, save_profile
from tpc.compiler.frontend import file_sha256


@pytest.fixture(scope="session")
def tiny_profile(tmp_path_factory, repo_root):
    """The model file, its profile on disk, and the profile as loaded back (equal to the one
    measured: every fit and sample survives the file)."""
    tmp = tmp_path_factory.mktemp("tiny-profile")
    src = write_tiny_gpt(tmp / "tiny.py", repo_root)
    prof = profile_model(str(src), L, SIZES, warmup=0, repeats=1)
    path = tmp / "tiny.msgpack"
    save_profile(prof, path)
    loaded = load_profile(path, model_sha256=file_sha256(str(src)), device=device_name("cpu"))
    assert loaded == prof
    return dict(src=src, path=path, profile=loaded)
