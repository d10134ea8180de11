"""Every output path of every command is checked before the command does its work: an existing
folder where a file goes, a folder under a file, a missing folder, a folder no file can be
created in (a read-only file system). Each is refused with the path, the flag and what to do,
exit status 1, no traceback -- and before anything else is read (the inputs named here do not
even exist, so a refusal that came later would be about them)."""

from __future__ import annotations

import errno
import os

import pytest

from tpc.cli.main import main


def _commands(out: str) -> dict[str, list[str]]:
    """Each command writing to `out`, with inputs that do not exist."""
    return {
        "compile -o": ["compile", "missing_model.py", "-o", out, "--seq-len", "16", "--batch", "2"],
        "profile -o": ["profile", "missing_model.py", "-o", out, "--seq-len", "16"],
        "simulate --trace": ["simulate", "missing.tpir", "--unit", "--trace", out],
        "simulate --png": ["simulate", "missing.tpir", "--unit", "--png", out],
        "export -o": ["export", "missing_ck", "-o", out if out.endswith(".pt") else out + ".pt"],
        "export-schedule -o": ["export-schedule", "missing.tpir", "-o", out],
        "run --metrics": ["run", "--interpret", "missing.tpir", "--metrics", out],
        "run --trace": ["run", "--interpret", "missing.tpir", "--trace", out],
    }


FLAG = {"compile -o": "--output", "profile -o": "--output", "simulate --trace": "--trace",
        "simulate --png": "--png", "export -o": "-o", "export-schedule -o": "--output",
        "run --metrics": "--metrics", "run --trace": "--trace"}
# these create missing folders themselves: a missing folder is not refused
CREATE_FOLDERS = {"export -o", "run --metrics", "run --trace"}


def _refused(argv, capsys) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "hint:" in err
    return err


@pytest.mark.parametrize("command", list(FLAG))
def test_a_folder_where_a_file_goes(command, tmp_path, capsys):
    folder = tmp_path / "a_folder.pt"
    folder.mkdir()
    err = _refused(_commands(str(folder))[command], capsys)
    assert f"{FLAG[command]}: error: cannot write {folder}" in err and "it is a folder" in err


@pytest.mark.parametrize("command", list(FLAG))
def test_a_folder_under_a_file(command, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    err = _refused(_commands(str(tmp_path / "file" / "out.pt"))[command], capsys)
    assert f"{FLAG[command]}: error: cannot write {tmp_path / 'file' / 'out'}" in err
    assert f"{tmp_path / 'file'} is a file, not a folder" in err


@pytest.mark.parametrize("command", sorted(set(FLAG) - CREATE_FOLDERS))
def test_a_missing_folder(command, tmp_path, capsys):
    out = tmp_path / "no" / "such" / "out.pt"
    err = _refused(_commands(str(out))[command], capsys)
    assert f"cannot write {out}: its folder {out.parent} does not exist" in err and "mkdir -p" in err


def _read_only(monkeypatch, folder):
    """Creating a file under `folder` fails as on a read-only mount (chmod does not stop root)."""
    real = os.open

    def fake(path, flags, *a, **k):
        if str(path).startswith(str(folder)) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", fake)


@pytest.mark.parametrize("command", list(FLAG))
def test_a_read_only_folder(command, tmp_path, capsys, monkeypatch):
    _read_only(monkeypatch, tmp_path)
    out = tmp_path / "out.pt"
    err = _refused(_commands(str(out))[command], capsys)
    assert f"cannot write {out}: cannot create files in {tmp_path}: the file system is read-only" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder of mode 0o555")
def test_a_folder_without_write_permission(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        err = _refused(_commands(str(locked / "m.jsonl"))["run --metrics"], capsys)
        assert "permission denied" in err
    finally:
        locked.chmod(0o755)


def test_checkpoint_dir_and_compile_bundles_want_folders(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    err = _refused(["run", "--interpret", "missing.tpir", "--checkpoint-dir", str(tmp_path / "file")], capsys)
    assert f"--checkpoint-dir: error: cannot write {tmp_path / 'file'}: it is a file, and a folder is written" in err
    err = _refused(["compile", "missing_model.py", "-o", str(tmp_path / "file"), "--seq-len", "16,32",
                    "--batch", "2"], capsys)
    assert "it is a file, and a folder is written here" in err
    # a missing checkpoint folder is created (and its parents): not refused, nothing created yet
    deep = tmp_path / "a" / "b" / "ck"
    _read_only(monkeypatch, tmp_path)
    err = _refused(["run", "--interpret", "missing.tpir", "--checkpoint-dir", str(deep)], capsys)
    assert f"cannot create files in {tmp_path}: the file system is read-only" in err
    assert not (tmp_path / "a").exists()
