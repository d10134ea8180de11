"""One run per checkpoint folder: the lock a `tpc run --checkpoint-dir DIR` holds on DIR.

Two runs saving into one folder would each claim steps that hold the other's weights, and each
replace the other's `latest`. So a run takes DIR/.tpc-lock before it loads or saves anything, and
a second run on DIR is refused with a message naming the process that holds it:

    DIR/.tpc-lock   {"pid": 4321, "host": "node7", "started": "2025-...", "command": "tpc run ..."}

The lock is an `fcntl.flock` on that file (the kernel drops it when the process ends, however it
ends: an exception, Ctrl-C, `kill -9`), and the file records who holds it, for the message. A
lock whose holder is gone is stale and taken over with a warning:

- its file is there but no process holds the flock (the holder was killed before it could
  remove the file), and, when it names a process of this host, that process is gone;
- it names another host (a folder on a shared file system, where `flock` may stay local to each
  machine) and has shown no sign of life for `STALE_AFTER` seconds: the holder touches the file
  every `HEARTBEAT` seconds while it runs.

Under torchrun one process, global rank 0, holds the lock for the whole run (every process
writes into DIR, and all of them run or none does; the caller shares rank 0's outcome).
`release()` removes the file (and the folder, when the lock created it and the run saved nothing
into it); it runs on every way out of the training loop, and `release_held()`
lets a process that leaves at once (os._exit) drop its locks first.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from tpc.ir.diagnostics import Diagnostic, TpirError

LOCK_FILE = ".tpc-lock"
HEARTBEAT = 30.0  # seconds between the holder's touches of the lock file
STALE_AFTER = 300.0  # a lock of another host untouched this long is taken over

try:  # POSIX; elsewhere the record alone decides (see _Flock)
    import fcntl
except ImportError:  # pragma: no cover - not on the platforms tpc runs on
    fcntl = None

_held: set["DirLock"] = set()


def _host() -> str:
    return socket.gethostname()


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def describe_holder(record: dict) -> str:
    """'process 4321 on node7 (started 2025-...; tpc run ...)', or what of it is known."""
    if not record:
        return "another process (its lock file says nothing about it)"
    text = f"process {record.get('pid', '?')} on {record.get('host', '?')}"
    extra = [str(record[k]) for k in ("started", "command") if record.get(k)]
    return text + (f" (started {'; '.join(extra)})" if extra else "")


class DirLock:
    """The lock of one checkpoint folder (module docstring): `acquire()` or refuse, `release()`."""

    def __init__(self, folder: str | os.PathLike, *, say=None):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self._fd: int | None = None
        self._flocked = False  # the file system gave us an flock (else the record alone decides)
        self._created = False  # acquire() created the folder
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # ------------------------------------------------------------------------- taking it

    def acquire(self) -> "DirLock":
        """Hold the lock, taking over a stale one (said with a warning); a TpirError naming the
        holder when a live run holds it."""
        self._created = not self.folder.exists()  # removed again by release() if left empty
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            from tpc.ir.files import write_error

            raise write_error(self.folder, e) from None
        for _ in range(20):  # a holder may remove the file between our open and our flock
            fd = self._open()
            try:
                if self._try_flock(fd) and self._same_file(fd):
                    record = _read_record(self.path)
                    stale = self._stale_reason(record)
                    self._write_record(fd)
                    self._fd = fd
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        else:  # pragma: no cover - only under a storm of lock and unlock
            raise self._refusal(_read_record(self.path))
        if stale:
            self.say(f"warning: {self.folder} was locked by {describe_holder(record)}, {stale}; "
                     f"this run takes the lock over")
        _held.add(self)
        self._beat = threading.Thread(target=self._heartbeat, name="tpc-dir-lock", daemon=True)
        self._beat.start()
        return self

    def check_free(self) -> None:
        """Refuse now, before any work, when a live run holds the lock (takes nothing: the run
        acquires it when it starts training)."""
        if not self.path.is_file():
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return  # acquire() says what is wrong
        try:
            if self._try_flock(fd):
                self._stale_reason(_read_record(self.path))
        finally:
            os.close(fd)  # drops a flock taken here

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            from tpc.ir.files import write_error

            raise write_error(self.path, e) from None

    def _try_flock(self, fd: int) -> bool:
        """True when this process now holds the flock (or the file system has none: the record
        decides); a refusal when a live process holds it."""
        self._flocked = False
        if fcntl is None:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._refusal(_read_record(self.path)) from None
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return True  # no flock on this file system: the record alone decides
            raise
        self._flocked = True
        return True

    def _same_file(self, fd: int) -> bool:
        """The locked file is still the one at `path` (not one a holder removed meanwhile)."""
        try:
            return os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _stale_reason(self, record: dict) -> str | None:
        """None for a fresh lock file; why a recorded holder no longer holds it; a refusal when
        it may still (a live process of this host, a recent heartbeat of another host)."""
        if not record:
            return None
        pid, host = record.get("pid"), record.get("host")
        if host == _host():
            if not isinstance(pid, int) or pid == os.getpid():
                return None
            if self._flocked:  # the kernel dropped its flock: the process ended
                return "which ended without removing it"
            if _alive(pid):  # no flock here: the record decides
                raise self._refusal(record)
            return "which is no longer running"
        try:
            age = time.time() - os.stat(self.path).st_mtime
        except OSError:
            age = float("inf")
        if age < STALE_AFTER:
            raise self._refusal(record, age=age)
        return f"which has shown no sign of life for {age:.0f} s (another host's run is taken as gone after {STALE_AFTER:.0f} s)"

    def _refusal(self, record: dict, age: float | None = None) -> TpirError:
        seen = f"; its last sign of life was {age:.0f} s ago" if age is not None else ""
        return TpirError(Diagnostic(
            f"{self.folder} is in use by another run: {describe_holder(record)}{seen}",
            where="--checkpoint-dir",
            hint=f"two runs saving into one folder would overwrite each other's checkpoints: wait for "
                 f"that run to end, or give this one another --checkpoint-dir. If that run is gone "
                 f"(its machine down), remove {self.path}"))

    def _write_record(self, fd: int) -> None:
        record = {"pid": os.getpid(), "host": _host(),
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:500]}
        data = (json.dumps(record) + "\n").encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        try:
            os.fsync(fd)
        except OSError:
            pass  # best effort: the flock, not the record, is what excludes

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            fd = self._fd
            if fd is None:
                return
            try:
                os.utime(fd)
            except OSError:
                pass  # a missed beat: the next one may succeed; STALE_AFTER allows many

    # ------------------------------------------------------------------------ letting go

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file and drop the flock; a no-op when not held."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._stop.set()
        _held.discard(self)
        try:
            if self._same_file(fd):
                os.unlink(self.path)  # before the flock goes: no one takes a file being removed
        except OSError:
            pass  # the next run finds a file no one holds: a stale lock, taken over
        finally:
            os.close(fd)  # drops the flock
        if self._created:
            try:
                self.folder.rmdir()  # a run that saved nothing leaves no folder behind
            except OSError:
                pass  # not empty: it holds checkpoints

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def release_held() -> None:
    """Release every lock this process holds (before an os._exit, which runs no `finally`)."""
    for lock in list(_held):
        lock.release()
