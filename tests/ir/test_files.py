"""Writing a user's file all or nothing (ir/files.py): a write that fails midway, however it
fails, leaves the old file as it was and no temporary file beside it."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from tpc.ir import files
from tpc.ir.diagnostics import TpirError
from tpc.ir.files import atomic_path, atomic_write_bytes, atomic_write_text, atomic_writer

OLD = "the old plan\n"


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "plan.tpir"
    path.write_text(OLD, encoding="utf-8")
    return path


def _left(folder):
    return sorted(p.name for p in folder.iterdir())


def test_a_write_replaces_the_file_and_leaves_nothing_else(target):
    atomic_write_text(target, "new\nlines\n")
    assert target.read_text(encoding="utf-8") == "new\nlines\n"
    atomic_write_bytes(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    with atomic_writer(target, "w") as f:
        f.write("streamed ")
        f.write("text\n")
    assert target.read_text(encoding="utf-8") == "streamed text\n"
    assert _left(target.parent) == ["plan.tpir"]


def test_a_new_file_gets_the_mode_open_would_give_and_an_old_file_keeps_its_own(tmp_path):
    new = tmp_path / "new.json"
    atomic_write_text(new, "{}\n")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0o600
    new.chmod(0o640)
    atomic_write_text(new, "[]\n")
    assert stat.S_IMODE(new.stat().st_mode) == 0o640


class _Boom(Exception):
    """A failure in the middle of a write, raised by the test itself."""


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), _Boom("the caller failed"),
                                   KeyboardInterrupt()])
def test_a_write_that_fails_midway_leaves_the_old_file(target, error):
    with pytest.raises((TpirError, _Boom, KeyboardInterrupt)) as caught:
        with atomic_writer(target, "w") as f:
            f.write("half of the new ")
            f.flush()
            raise error
    assert target.read_text(encoding="utf-8") == OLD
    assert _left(target.parent) == ["plan.tpir"]
    if isinstance(error, OSError):  # an OSError reaches the user located, in words
        assert caught.type is TpirError
        assert str(target) in str(caught.value) and "the disk is full" in str(caught.value)
    else:
        assert caught.type is type(error)


def test_a_failing_write_call_leaves_the_old_file(target, monkeypatch):
    """The text object's write raising part way (as a full disk does)."""
    real_open = open

    class Failing:
        def __init__(self, f):
            self.f = f

        def write(self, s):
            self.f.write(s[: len(s) // 2])
            self.f.flush()
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(files, "open", lambda *a, **k: Failing(real_open(*a, **k)), raising=False)
    with pytest.raises(TpirError, match="the disk is full"):
        atomic_write_text(target, "x" * 10_000)
    assert target.read_text(encoding="utf-8") == OLD
    assert _left(target.parent) == ["plan.tpir"]


def test_a_library_that_writes_by_name_fails_and_the_old_file_stays(target):
    with pytest.raises(_Boom):
        with atomic_path(target) as tmp:
            tmp.write_text("half", encoding="utf-8")
            raise _Boom()
    assert target.read_text(encoding="utf-8") == OLD
    assert _left(target.parent) == ["plan.tpir"]


def test_the_file_size_limit_stops_the_write_and_the_old_file_stays(target):
    """A real failure from the kernel: RLIMIT_FSIZE in a child process (SIGXFSZ ignored, so the
    write fails with EFBIG instead of killing the process)."""
    code = textwrap.dedent(f"""
        import resource, signal, sys
        from tpc.ir.diagnostics import TpirError
        from tpc.ir.files import atomic_write_text
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            atomic_write_text({str(target)!r}, "y" * 100_000)
        except TpirError as e:
            print(e)
            sys.exit(3)
        sys.exit(0)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert f"cannot write {target}" in done.stdout and "larger than this system allows" in done.stdout
    assert target.read_text(encoding="utf-8") == OLD
    assert _left(target.parent) == ["plan.tpir"]


def test_a_missing_folder_is_said_in_words(tmp_path):
    with pytest.raises(TpirError, match="its folder does not exist") as caught:
        atomic_write_text(tmp_path / "nowhere" / "plan.tpir", OLD)
    assert str(tmp_path / "nowhere" / "plan.tpir") in str(caught.value)


@pytest.mark.parametrize("code,words", [(errno.EROFS, "the file system is read-only"),
                                        (errno.EACCES, "read-only to this user")])
def test_a_read_only_folder_is_said_in_words(target, monkeypatch, code, words):
    """(Simulated: the tests may run as root, who writes into a folder without write permission.)"""
    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(files.os, "open", refuse)
    with pytest.raises(TpirError, match=words):
        atomic_write_text(target, "new\n")
    monkeypatch.undo()
    assert target.read_text(encoding="utf-8") == OLD
    assert _left(target.parent) == ["plan.tpir"]
