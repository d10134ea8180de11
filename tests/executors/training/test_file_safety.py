"""What a failure cannot do to a checkpoint folder: two runs cannot share one (a lock, and a
stale lock of a killed run is taken over with a warning); a file changed after it was saved
(a flipped byte, same size) is refused with its name; a full disk, a file-size limit or Ctrl-C
during a save keeps nothing half-written and leaves the previous checkpoint the latest, and
says so."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_files

from tests.executors.training.test_checkpoint import META, _fresh_template, _shards, _trained
from tpc.cli.main import main
from tpc.executors.training import checkpoint, dir_lock
from tpc.executors.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tpc.executors.training.dir_lock import LOCK_FILE, DirLock
from tpc.ir.diagnostics import TpirError

ROOT = Path(__file__).resolve().parents[3]

HOLD = textwrap.dedent("""
    import sys, time
    from tpc.executors.training.dir_lock import DirLock
    DirLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(60)
""")


@pytest.fixture(autouse=True)
def no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of tmp_path/ck."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "ck")], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tests.executors.training.run_helpers import write_plan, write_tokens

    d = tmp_path_factory.mktemp("safety")
    return write_plan(d), write_tokens(d)


def _run(plan, ck, steps, *extra):
    return ["run", "--interpret", plan, "--steps", str(steps), "--device", "cpu", "--checkpoint-dir", str(ck),
            "-q", *extra]


# ------------------------------------------------------------------------------ the lock


def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_holder(files, tmp_path, holder, capsys):
    plan, _ = files
    started = time.perf_counter()
    assert main(_run(plan, tmp_path / "ck", 1)) == 1
    err = capsys.readouterr().err
    assert f"--checkpoint-dir: error: {tmp_path / 'ck'} is in use by another run: process {holder.pid} on " in err
    assert "another --checkpoint-dir" in err and "Traceback" not in err
    assert time.perf_counter() - started < 5  # at startup: before the plan and the model are loaded
    assert not (tmp_path / "ck" / "latest").exists()
    with pytest.raises(TpirError, match=f"in use by another run: process {holder.pid}"):
        DirLock(tmp_path / "ck").acquire()  # the run's own acquisition refuses too


def test_a_lock_is_released_on_every_way_out_and_a_killed_holders_is_taken_over(files, tmp_path, capsys):
    plan, _ = files
    ck = tmp_path / "ck"
    assert main(_run(plan, ck, 1)) == 0
    assert not (ck / LOCK_FILE).exists() and latest_checkpoint(ck).name == "step_000001"
    assert main(_run(plan, ck, 1, "--lr", "1e9", "--resume")) == 0  # nothing to train: still released
    assert not (ck / LOCK_FILE).exists()

    killed = subprocess.Popen([sys.executable, "-c", HOLD, str(ck)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert killed.stdout.readline().strip() == "held"
    killed.kill()  # kill -9: no cleanup runs, the lock file stays
    killed.wait()
    assert json.loads((ck / LOCK_FILE).read_text())["pid"] == killed.pid
    capsys.readouterr()
    assert main(_run(plan, ck, 2, "--resume")) == 0
    err = capsys.readouterr().err
    assert f"warning: {ck} was locked by process {killed.pid} on " in err and "takes the lock over" in err
    assert not (ck / LOCK_FILE).exists() and latest_checkpoint(ck).name == "step_000002"


def test_a_lock_of_another_host_is_stale_only_after_a_silence(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    ck.mkdir()
    record = {"pid": 1, "host": "elsewhere.example", "started": "then", "command": "tpc run p.tpir"}
    (ck / LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(TpirError, match="in use by another run: process 1 on elsewhere.example .*last sign of life"):
        DirLock(ck).acquire()
    old = time.time() - dir_lock.STALE_AFTER - 10
    os.utime(ck / LOCK_FILE, (old, old))
    said = []
    lock = DirLock(ck, say=said.append).acquire()
    assert "locked by process 1 on elsewhere.example" in said[0] and "no sign of life" in said[0]
    assert json.loads((ck / LOCK_FILE).read_text())["pid"] == os.getpid()

    # while held, the holder's heartbeat keeps the file fresh
    monkeypatch.setattr(dir_lock, "HEARTBEAT", 0.05)
    lock.release()
    lock = DirLock(ck).acquire()
    os.utime(ck / LOCK_FILE, (old, old))
    time.sleep(0.5)
    assert time.time() - (ck / LOCK_FILE).stat().st_mtime < 5
    with pytest.raises(TpirError, match="in use by another run"):
        DirLock(ck).acquire()  # this process, through another open file: refused as well
    dir_lock.release_held()
    assert not lock.held and not (ck / LOCK_FILE).exists()


# ------------------------------------------------------------------------------ checksums


def test_a_flipped_byte_is_refused_naming_the_file_and_an_old_checkpoint_loads_unverified(tmp_path):
    net, ranks, opts = _trained()
    save_checkpoint(tmp_path, 1, _shards(ranks, opts, 1), META)
    save_checkpoint(tmp_path, 2, _shards(ranks, opts, 2), META)
    step = tmp_path / "step_000002"
    meta = json.loads((step / "tpc.json").read_text())
    assert set(meta["files"]) == {p.name for p in step.iterdir() if p.name != "tpc.json"}
    assert all(len(v["sha256"]) == 64 for v in meta["files"].values())

    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(TpirError) as e:
        load_checkpoint(tmp_path, _fresh_template()[3])
    text = str(e.value)
    assert f"{step}: corrupt checkpoint: the file {shard.name} does not match the checksum" in text
    assert f"mv {step} {tmp_path / 'damaged_step_000002'}" in text and "--resume continues from" in text
    step.rename(tmp_path / "damaged_step_000002")  # as the hint says: the one before it loads
    assert load_checkpoint(tmp_path, _fresh_template()[3])["step"] == 1

    (tmp_path / "step_000001" / ".metadata").write_bytes(b"\0" * 10)
    with pytest.raises(TpirError, match="the file .metadata is 10 bytes"):
        load_checkpoint(tmp_path, _fresh_template()[3])


def test_resume_says_an_old_checkpoint_was_not_verified(files, tmp_path, capsys):
    plan, _ = files
    ck = tmp_path / "ck"
    assert main(_run(plan, ck, 1)) == 0
    meta_file = ck / "step_000001" / "tpc.json"
    meta = json.loads(meta_file.read_text())
    del meta["files"]  # as a checkpoint of an earlier tpc
    meta_file.write_text(json.dumps(meta))
    capsys.readouterr()
    assert main([a for a in _run(plan, ck, 2, "--resume") if a != "-q"]) == 0
    out = capsys.readouterr()
    assert "records no checksums (written by an earlier tpc): its files were loaded without verifying" in \
        out.out + out.err


# --------------------------------------------------------------- a full disk, Ctrl-C, a limit


def _failing_write(exc, after: int = 0):
    """DCP's write of one item, raising `exc` after `after` items."""
    real = dcp_files._write_item
    count = [0]

    def write(*a, **k):
        count[0] += 1
        if count[0] > after:
            raise exc
        return real(*a, **k)

    return write


def _previous_is_intact(tmp_path, net_state):
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    assert (tmp_path / "latest").read_text().strip() == "step_000001"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp_")] == []
    net2, _, _, template = _fresh_template()
    assert load_checkpoint(tmp_path, template)["step"] == 1
    for name, value in net2.state_dict().items():
        assert torch.equal(value, net_state[name]), name


@pytest.mark.parametrize("after", [0, 3])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch, after):
    net, ranks, opts = _trained()
    save_checkpoint(tmp_path, 1, _shards(ranks, opts, 1), META)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    monkeypatch.setattr(dcp_files, "_write_item", _failing_write(OSError(errno.ENOSPC, "No space left"), after))
    with torch.no_grad():
        net.lm_head.weight.add_(1.0)
    with pytest.raises(TpirError) as e:
        save_checkpoint(tmp_path, 2, _shards(ranks, opts, 2), META)
    text = str(e.value)
    assert f"cannot save checkpoint step_000002 (step 2) in {tmp_path}: the disk is full" in text
    assert f"the checkpoint before it, {tmp_path / 'step_000001'}, is as it was" in text
    _previous_is_intact(tmp_path, state)


def test_a_full_disk_while_writing_tpc_json_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    net, ranks, opts = _trained()
    save_checkpoint(tmp_path, 1, _shards(ranks, opts, 1), META)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    real = os.fsync

    def full(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".tpc.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(TpirError, match=r"cannot save checkpoint step_000002 .*the disk is full"):
        save_checkpoint(tmp_path, 2, _shards(ranks, opts, 2), META)
    monkeypatch.undo()
    _previous_is_intact(tmp_path, state)


def test_ctrl_c_during_a_save_keeps_the_previous_checkpoint_and_says_so(files, tmp_path, monkeypatch, capsys):
    net, ranks, opts = _trained()
    save_checkpoint(tmp_path, 1, _shards(ranks, opts, 1), META)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    monkeypatch.setattr(dcp_files, "_write_item", _failing_write(KeyboardInterrupt(), after=2))
    with pytest.raises(KeyboardInterrupt, match="while saving checkpoint step_000002 .*nothing of it was kept"):
        save_checkpoint(tmp_path, 2, _shards(ranks, opts, 2), META)
    monkeypatch.undo()
    _previous_is_intact(tmp_path, state)

    # through the command line: a message, status 130, no traceback, the folder unlocked
    plan, _ = files
    ck = tmp_path / "ck"
    assert main(_run(plan, ck, 1)) == 0
    monkeypatch.setattr(dcp_files, "_write_item", _failing_write(KeyboardInterrupt(), after=1))
    capsys.readouterr()
    assert main(_run(plan, ck, 2, "--resume")) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted: while saving checkpoint step_000002 (step 2)") and "Traceback" not in err
    assert f"{ck / 'step_000001'}, is as it was" in err
    assert latest_checkpoint(ck).name == "step_000001" and not (ck / LOCK_FILE).exists()


LIMITED = textwrap.dedent("""
    import resource, sys
    from tests.executors.training.test_checkpoint import META, _shards, _trained
    from tpc.executors.training.checkpoint import save_checkpoint
    from tpc.ir.diagnostics import TpirError
    net, ranks, opts = _trained()
    save_checkpoint(sys.argv[1], 1, _shards(ranks, opts, 1), META)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # as `ulimit -f 4`
    try:
        save_checkpoint(sys.argv[1], 2, _shards(ranks, opts, 2), META)
    except TpirError as e:
        print(e.render(), file=sys.stderr)
        sys.exit(1)
""")


def test_a_file_size_limit_during_a_save_is_said_and_keeps_the_previous_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, "-c", LIMITED, str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot save checkpoint step_000002 (step 2)" in done.stderr and "ulimit -f" in done.stderr
    assert "Traceback" not in done.stderr
    net, _, _ = _trained()
    _previous_is_intact(tmp_path, {k: v.clone() for k, v in net.state_dict().items()})


def test_a_read_only_checkpoint_folder_is_refused_before_the_run(files, tmp_path, monkeypatch, capsys):
    plan, _ = files
    ck = tmp_path / "ck"
    ck.mkdir()
    real = os.open

    def read_only(path, flags, *a, **k):  # as a read-only mount (chmod does not stop root)
        if str(path).startswith(str(ck)) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    assert main(_run(plan, ck, 1)) == 1
    err = capsys.readouterr().err
    assert f"--checkpoint-dir: error: cannot write {ck}: cannot create files in {ck}: the file system is " \
           "read-only" in err
    assert checkpoint.latest_checkpoint(ck) is None


# ------------------------------------------------------------------------ under torchrun


def _dist_worker(rank, world, path, port, holder_pid):
    from tests.executors.training.test_checkpoint import _part
    from tpc.executors.training.run_checkpoints import RunCheckpoints

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        net, ranks, opts = _trained()
        root = Path(path) / "saves"
        save_checkpoint(root, 1, _part(ranks[rank], opts[rank], 1, rank), META)
        if rank == 1:  # one rank's disk fills: every rank says so, and the half is removed
            dcp_files._write_item = _failing_write(OSError(errno.ENOSPC, "No space left"))
        try:
            save_checkpoint(root, 2, _part(ranks[rank], opts[rank], 2, rank), META)
            raise SystemExit(f"rank {rank}: a save on a full disk did not fail")
        except TpirError as e:
            if "the disk is full" not in str(e) or "step_000001, is as it was" not in str(e):
                raise SystemExit(f"rank {rank}: {e}")
        torch.distributed.barrier()
        if latest_checkpoint(root).name != "step_000001" or any(p.name.startswith(".tmp_") for p in root.iterdir()):
            raise SystemExit(f"rank {rank}: the failed save left {sorted(p.name for p in root.iterdir())}")

        # the folder is locked by the parent: rank 0 finds out, and every rank refuses alike
        ck = RunCheckpoints(dir=Path(path) / "ck", every=0, total=1, resume=False, meta={}, seed=0, source="random")
        try:
            ck.lock()
            raise SystemExit(f"rank {rank}: took a lock held by another process")
        except TpirError as e:
            if f"in use by another run: process {holder_pid} on" not in str(e):
                raise SystemExit(f"rank {rank}: {e}")
    finally:
        torch.distributed.destroy_process_group()


def test_under_torchrun_every_rank_refuses_a_locked_folder_and_reports_a_full_disk(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with DirLock(tmp_path / "ck"):
        mp.start_processes(_dist_worker, args=(2, str(tmp_path), port, os.getpid()), nprocs=2, join=True,
                           start_method="fork")
    assert not (tmp_path / "ck").exists()
