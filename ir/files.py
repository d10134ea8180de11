"""Writing a user's file so that it is either the old file or the whole new one, never half.

Every file tpc writes for the user (a plan, a trace, a profile, a checkpoint's `latest`, a
rewritten metrics log) goes through here: the bytes go to a temporary file beside the target (same
folder, so the same file system), are flushed and fsync'd, and `os.replace` puts the file in place
in one step; the folder is fsync'd after, so the rename survives a crash. Anything that stops the
write first (a full disk, a file-size limit, an exception in the caller's code, Ctrl-C) removes
the temporary file and leaves the target as it was.

    atomic_write_text(path, text)
    atomic_write_bytes(path, data)
    with atomic_writer(path, "w") as f: ...    # a file object, for writers that stream
    with atomic_path(path) as tmp: ...          # a path, for libraries that write by name
    check_output(path, option="-o")             # before the work: could it be written at all?

An `OSError` reaches the user as a located `TpirError` that names the file and says what went
wrong in words ("the disk is full", "the file system is read-only"). Nothing here knows torch.

Reading a user's text file (a plan, a bundle index, a schedule CSV) goes through `read_text`:
a byte that is not UTF-8 is reported at its `file:line:col`, with the line shown.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Loc

# what an errno means to someone writing a file, and what to do about it
_REASONS = {
    errno.ENOSPC: ("the disk is full", "free some space, or write it elsewhere"),
    errno.EDQUOT: ("the disk quota is used up", "free some space, or write it elsewhere"),
    errno.EFBIG: ("the file is larger than this system allows (a file-size limit, `ulimit -f`?)",
                  "raise the limit, or write it to another file system"),
    errno.EROFS: ("the file system is read-only", "write it to a writable folder"),
    errno.EACCES: ("permission denied: the folder or the file is read-only to this user",
                   "write it to a folder you may write to, or change its permissions"),
    errno.EPERM: ("operation not permitted: the folder or the file is read-only to this user",
                  "write it to a folder you may write to, or change its permissions"),
    errno.ENOENT: ("its folder does not exist", "create the folder first, or write it elsewhere"),
    errno.ENOTDIR: ("a part of its folder is not a folder", "check the path"),
    errno.EISDIR: ("it is a folder", "give a file name, not a folder"),
}


def describe_os_error(error: OSError) -> tuple[str, str]:
    """What `error` means to someone writing a file, and what to do: ("the disk is full", "free
    some space, or write it elsewhere")."""
    return _REASONS.get(error.errno, (error.strerror or type(error).__name__, "check the path and the disk"))


def read_text(path: str | os.PathLike, *, what: str = "a .tpir plan") -> str:
    """The UTF-8 text of the file at `path`; a TpirError for a missing or unreadable file, and
    for a byte that is not UTF-8, located at its line and column (the column counts
    characters, as every location does)."""
    name = os.fspath(path)
    p = Path(path)
    if not p.is_file():
        raise TpirError(Diagnostic("no such file", hint=f"give the path of {what}", where=name))
    try:
        data = p.read_bytes()
    except OSError as e:
        raise TpirError(Diagnostic(f"cannot read it: {e.strerror or e}", where=name,
                                   hint=f"give the path of {what} you may read")) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        start = data.rfind(b"\n", 0, e.start) + 1
        line = data.count(b"\n", 0, e.start) + 1
        col = len(data[start:e.start].decode("utf-8")) + 1
        bad = data[e.start:e.end].hex(" ")
        raise TpirError(Diagnostic(
            f"byte 0x{bad} is not UTF-8 text ({e.reason})", loc=Loc(name, line, col),
            hint=f"{what} is a UTF-8 text file: remove the byte, or re-save the file as UTF-8"),
            source=data.decode("utf-8", errors="replace")) from None


def write_error(path: str | os.PathLike, error: OSError) -> TpirError:
    """The located error for `error` while writing `path`."""
    reason, hint = describe_os_error(error)
    return TpirError(Diagnostic(f"cannot write {os.fspath(path)}: {reason}", hint=hint, where=os.fspath(path)))


def check_output(path: str | os.PathLike, *, option: str, folder: bool = False, parents: bool = False) -> None:
    """Refuse, before any work, an output that could not be written at the end of it: `path` is
    a file to write (`folder=False`: not an existing folder) or a folder to write into
    (`folder=True`: not an existing file); the folder it goes in must be a folder this process may
    create files in (tried: a file is created there and removed), and must exist unless `parents`
    (the writer creates missing folders: then the nearest existing one must be usable). A
    TpirError located at `option` (the flag that named the path) says which and what to do."""
    target = Path(path)

    def refuse(message: str, hint: str) -> TpirError:
        return TpirError(Diagnostic(f"cannot write {os.fspath(path)}: {message}", where=option, hint=hint))

    if target.is_dir() and not folder:
        raise refuse("it is a folder, and a file is written here",
                     f"give a file name (e.g. {os.fspath(target / 'NAME')}), or remove the folder")
    if target.exists() and not target.is_dir() and folder:
        raise refuse("it is a file, and a folder is written here", "give a folder name, or remove the file")
    home = target if folder and target.is_dir() else target.absolute().parent
    nearest = home
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise refuse(f"{nearest} is a file, not a folder", "check the path: a file cannot hold other files")
    if nearest != home and not parents:
        raise refuse(f"its folder {home} does not exist", f"create it first (mkdir -p {home}), or write elsewhere")
    try:
        fd, probe = _temporary_beside(nearest / ".tpc-write-check")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason, hint = describe_os_error(e)
        raise refuse(f"cannot create files in {nearest}: {reason}", hint) from None


def _temporary_beside(target: Path) -> tuple[int, Path]:
    """A new file in `target`'s folder, open for writing, with the mode `open(target, "w")` would
    leave: the old file's mode if there is one, else 0o666 less the umask (not mkstemp's 0o600)."""
    stem = target.name[:200]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = target.with_name(f".{stem}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
    try:
        os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
    except OSError:
        pass  # no old file (or one we may not stat): the umask's mode stays
    return fd, tmp


def fsync_folder(folder: str | os.PathLike) -> None:
    """Make a rename in `folder` durable (best effort: some file systems cannot open folders;
    the rename is still atomic there)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # best effort (module docstring): the rename itself is atomic either way
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that takes a file name (and closes the file
    itself). When the block ends normally the file is fsync'd and replaces `path`; when it
    raises, the temporary file is removed and `path` is untouched. OSError -> TpirError."""
    target = Path(path)
    try:
        fd, tmp = _temporary_beside(target)
    except OSError as e:
        raise write_error(target, e) from e
    os.close(fd)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass  # already gone: nothing of the write is left
        if isinstance(e, OSError):
            raise write_error(target, e) from e
        raise
    fsync_folder(target.parent)


@contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w", *, encoding: str = "utf-8",
                  newline: str | None = "\n") -> Iterator[IO]:
    """A file object (mode "w" for text, "wb" for bytes) whose contents replace `path` when the
    block ends normally; see `atomic_path`. Text is written with `encoding` and `newline`."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_writer writes a whole file: mode 'w' or 'wb', not {mode!r}")
    text = {"encoding": encoding, "newline": newline} if mode == "w" else {}
    target = Path(path)
    with atomic_path(target) as tmp:
        try:
            f = open(tmp, mode, **text)
        except OSError as e:
            raise write_error(target, e) from e
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def atomic_write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8",
                      newline: str | None = "\n") -> None:
    """Replace `path` with `text`, all or nothing (module docstring)."""
    with atomic_writer(path, "w", encoding=encoding, newline=newline) as f:
        f.write(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data`, all or nothing (module docstring)."""
    with atomic_writer(path, "wb") as f:
        f.write(data)
