import json
import os

import pytest
import torch

from tests.executors.training.models.tiny_gpt import model as tiny_model
from tpc.executors.training.checkpoint import (init_optimizer_state, latest_checkpoint, load_checkpoint,
                                               optimizer_state, read_meta, restore_rng, rng_state, save_checkpoint,
                                               step_dir_name)
from tpc.executors.training.param_groups import build_optimizer
from tpc.ir.diagnostics import TpirError

META = {"plan_sha256": "ab" * 32, "mesh": {"pipe": 2, "data": 1}}


def _split(net):
    """Two 'ranks': embeddings + block 0, and block 1 + head. The tied embedding/head is one
    tensor here, named wte.weight on rank 0 and lm_head.weight on rank 1."""
    named = dict(net.named_parameters(remove_duplicate=False))
    r0 = [(n, p) for n, p in named.items() if n.startswith(("wte", "wpe", "h.0"))]
    r1 = [(n, p) for n, p in named.items() if not n.startswith(("wte", "wpe", "h.0"))]
    return [r0, r1]


def _trained(seed=0, steps=2):
    torch.manual_seed(seed)
    net = tiny_model()
    ranks = _split(net)
    opts = [build_optimizer("adamw", r, 1e-2, 0.1) for r in ranks]
    for _ in range(steps):
        net(torch.randint(0, 256, (2, 8))).square().mean().backward()
        for o in opts:  # the tied tensor is shared by both "ranks" here: zero grads after all steps
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
    return net, ranks, opts


def _part(named, opt, step, rank):
    """What one rank saves (the layout of model_state.state_to_save): its parameters by name (a
    tensor once), their optimizer state, the step, its RNG and the data position."""
    params = {}
    for n, p in named:
        if all(p is not q for q in params.values()):
            params[n] = p
    return {"params": {n: p.detach() for n, p in params.items()}, "optim": optimizer_state(opt, params.items()),
            "step": step, "rng": {f"rank{rank}": rng_state()}, "data": {"seed": 7, "next_step": step}}


def _shards(ranks, opts, step):
    """Both 'ranks' in one dict, as the interpreter saves them."""
    out = {"params": {}, "optim": {}, "rng": {}}
    for r, (named, opt) in enumerate(zip(ranks, opts)):
        part = _part(named, opt, step, r)
        for key in ("params", "optim", "rng"):
            for k, v in part[key].items():
                if all(v is not w for w in out[key].values()):
                    out[key].setdefault(k, v)
        out["step"], out["data"] = part["step"], part["data"]
    return out


def _fresh_template(seed=123):
    torch.manual_seed(seed)
    net = tiny_model()
    ranks = _split(net)
    opts = [build_optimizer("adamw", r, 1e-2, 0.1) for r in ranks]
    for o in opts:
        init_optimizer_state(o)
    return net, ranks, opts, _shards(ranks, opts, step=0)


def test_round_trip_restores_weights_optimizer_step_data_and_rng(tmp_path):
    net, ranks, opts = _trained()
    torch.manual_seed(99)
    expected_rand = torch.rand(3)
    torch.manual_seed(99)
    path = save_checkpoint(tmp_path, 2, _shards(ranks, opts, step=2), META)
    assert path == tmp_path / "step_000002" and latest_checkpoint(tmp_path) == path
    assert read_meta(tmp_path)["step"] == 2 and read_meta(tmp_path)["plan_sha256"] == META["plan_sha256"]

    net2, ranks2, opts2, template = _fresh_template()
    assert not torch.equal(net2.lm_head.weight, net.lm_head.weight)
    loaded = load_checkpoint(tmp_path, template)
    assert loaded is template and loaded["step"] == 2
    assert loaded["data"] == {"seed": 7, "next_step": 2}
    for a, b in zip(net.state_dict().values(), net2.state_dict().values()):
        assert torch.equal(a, b)
    restore_rng(loaded["rng"]["rank0"])
    assert torch.equal(torch.rand(3), expected_rand)
    # the optimizer state came back too: one more identical step gives identical weights
    x = torch.randint(0, 256, (2, 8))
    for m, os_ in ((net, opts), (net2, opts2)):
        m(x).square().mean().backward()
        for o in os_:
            o.step()
    for (n, a), b in zip(net.named_parameters(), net2.parameters()):
        assert torch.equal(a, b), n


def test_rng_state_of_another_device_kind_is_optional(tmp_path):
    net, ranks, opts = _trained()
    save_checkpoint(tmp_path, 1, _shards(ranks, opts, 1), META)
    _, _, _, template = _fresh_template()
    mine = torch.arange(4, dtype=torch.uint8)
    template["rng"]["rank0"]["torch_cuda"] = mine  # as a CUDA run would have
    template["rng"]["rank5"] = rng_state()  # a rank the checkpoint's run did not have
    loaded = load_checkpoint(tmp_path, template)
    assert loaded["rng"]["rank0"]["torch_cuda"] is mine and torch.equal(mine, torch.arange(4, dtype=torch.uint8))
    assert loaded["step"] == 1 and loaded["data"]["next_step"] == 1
    template["extra"] = torch.zeros(1)  # outside the optional section: still refused
    with pytest.raises(TpirError, match="extra is not in the checkpoint"):
        load_checkpoint(tmp_path, template)


def test_latest_follows_the_newest_and_a_step_can_be_saved_again(tmp_path):
    net, ranks, opts = _trained()
    save_checkpoint(tmp_path, 1, _shards(ranks, opts, 1), META)
    save_checkpoint(tmp_path, 3, _shards(ranks, opts, 3), META)
    assert (tmp_path / "latest").read_text().strip() == "step_000003"
    with torch.no_grad():
        ranks[0][0][1].add_(1.0)
    save_checkpoint(tmp_path, 3, _shards(ranks, opts, 3), META)
    _, ranks2, _, template = _fresh_template()
    load_checkpoint(tmp_path, template)
    assert torch.equal(ranks2[0][0][1], ranks[0][0][1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001", "step_000003"]


def test_crash_before_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import tpc.executors.training.checkpoint as ck

    net, ranks, opts = _trained()
    save_checkpoint(tmp_path, 1, _shards(ranks, opts, 1), META)
    saved = {k: v.clone() for k, v in net.state_dict().items()}

    def crash(*a, **k):
        raise RuntimeError("power cut")

    monkeypatch.setattr(ck, "_publish", crash)
    with torch.no_grad():
        net.lm_head.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="power cut"):
        save_checkpoint(tmp_path, 2, _shards(ranks, opts, 2), META)
    assert (tmp_path / ".tmp_step_000002").is_dir()  # written, never published
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    net2, _, _, template = _fresh_template()
    assert load_checkpoint(tmp_path, template)["step"] == 1
    assert torch.equal(net2.lm_head.weight, saved["lm_head.weight"])

    monkeypatch.undo()  # the next save cleans the stale temporary directory up
    save_checkpoint(tmp_path, 2, _shards(ranks, opts, 2), META)
    assert not (tmp_path / ".tmp_step_000002").exists() and latest_checkpoint(tmp_path).name == "step_000002"


def _save_then_die_mid_save(path):
    import tpc.executors.training.checkpoint as ck

    net, ranks, opts = _trained()
    ck.save_checkpoint(path, 5, _shards(ranks, opts, 5), META)
    ck._write_meta = lambda *a: os._exit(3)  # die after the shards, before tpc.json and the rename
    ck.save_checkpoint(path, 6, _shards(ranks, opts, 6), META)


def test_process_killed_mid_save_leaves_latest_loadable(tmp_path):
    import multiprocessing

    # a forked process that exits abruptly: no exception handler or cleanup runs
    proc = multiprocessing.get_context("fork").Process(target=_save_then_die_mid_save, args=(str(tmp_path),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 3
    assert (tmp_path / ".tmp_step_000006" / ".metadata").is_file()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000005"
    net, _, _ = _trained()
    net2, _, _, template = _fresh_template()
    load_checkpoint(tmp_path, template)
    for a, b in zip(net.state_dict().values(), net2.state_dict().values()):
        assert torch.equal(a, b)


def test_latest_falls_back_when_it_names_an_incomplete_directory(tmp_path):
    net, ranks, opts = _trained()
    save_checkpoint(tmp_path, 1, _shards(ranks, opts, 1), META)
    save_checkpoint(tmp_path, 2, _shards(ranks, opts, 2), META)
    (tmp_path / "step_000002" / "tpc.json").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    with pytest.raises(TpirError, match="did not finish"):
        load_checkpoint(tmp_path / "step_000002", _fresh_template()[3])


def test_missing_empty_mismatched_and_corrupt_checkpoints_are_refused(tmp_path):
    with pytest.raises(TpirError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "nope", {})
    assert latest_checkpoint(tmp_path / "nope") is None
    with pytest.raises(TpirError, match="no complete checkpoint"):
        load_checkpoint(tmp_path, {})

    net, ranks, opts = _trained()
    save_checkpoint(tmp_path, 1, _shards(ranks, opts, 1), META)
    torch.manual_seed(0)
    wider = tiny_model(n_embd=32)
    template = {"params": {n: p.detach() for n, p in wider.named_parameters()}}
    with pytest.raises(TpirError, match=r"does not match this run.*wpe.weight is stored as torch.float32 \[16, 16\]"):
        load_checkpoint(tmp_path, template)
    with pytest.raises(TpirError, match="rank7.step is not in the checkpoint"):
        load_checkpoint(tmp_path, {"rank7": {"step": 0}})

    shard = next((tmp_path / "step_000001").glob("*.distcp"))
    good = shard.read_bytes()
    shard.write_bytes(b"\0" * len(good))  # the right length, damaged contents
    with pytest.raises(TpirError, match=rf"corrupt checkpoint: the file {shard.name} does not match the checksum"):
        load_checkpoint(tmp_path, _fresh_template()[3])
    meta_file = tmp_path / "step_000001" / "tpc.json"  # without checksums (an earlier tpc's) DCP finds it
    meta_file.write_text(json.dumps({k: v for k, v in json.loads(meta_file.read_text()).items() if k != "files"}))
    with pytest.raises(TpirError, match=r"corrupt checkpoint: reading the shards failed \(\w+Error: "):
        load_checkpoint(tmp_path, _fresh_template()[3])
    shard.write_bytes(good[:50])
    with pytest.raises(TpirError, match=rf"corrupt checkpoint: the data file {shard.name} is 50 bytes, its entries "
                                        r"need \d+ \(truncated\)"):
        load_checkpoint(tmp_path, _fresh_template()[3])
    shard.unlink()
    with pytest.raises(TpirError, match=rf"corrupt checkpoint: the data file {shard.name} is missing"):
        load_checkpoint(tmp_path, _fresh_template()[3])
    (tmp_path / "step_000001" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(TpirError, match="corrupt checkpoint") as e:
        load_checkpoint(tmp_path, _fresh_template()[3])
    assert "hint:" in str(e.value)


def test_a_checkpoint_of_an_unknown_format_is_refused_naming_it(tmp_path):
    import json

    net, ranks, opts = _trained()
    save_checkpoint(tmp_path, 1, _shards(ranks, opts, 1), META)
    assert read_meta(tmp_path)["format"] == 2  # what this version writes
    meta_file = tmp_path / "step_000001" / "tpc.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "format": 3}))
    with pytest.raises(TpirError, match="the checkpoint is of format 3; this version of tpc reads formats 1, 2"):
        read_meta(tmp_path)


def test_shards_must_be_nested_dicts():
    with pytest.raises(TypeError):
        save_checkpoint("/tmp/unused", 0, {"params": [torch.zeros(1)]}, {})


def _dist_worker(rank, world, path, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        net, ranks, opts = _trained()
        # each process saves and loads its own part
        save_checkpoint(path, 4, _part(ranks[rank], opts[rank], 4, rank), META)
        _, ranks2, opts2, _ = _fresh_template()
        for o in opts2:
            init_optimizer_state(o)
        load_checkpoint(path, _part(ranks2[rank], opts2[rank], 0, rank))
        for (n, a), (_, b) in zip(ranks[rank], ranks2[rank]):
            if not torch.equal(a, b):
                raise SystemExit(f"rank {rank}: {n} differs after a distributed load")
    finally:
        torch.distributed.destroy_process_group()


def test_torchrun_style_save_by_two_processes_loads_in_one(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the children reuse the imported torch instead of importing it again (seconds each)
    mp.start_processes(_dist_worker, args=(2, str(tmp_path), port), nprocs=2, join=True, start_method="fork")
    assert latest_checkpoint(tmp_path) == tmp_path / step_dir_name(4)
    net, _, _ = _trained()
    net2, _, _, template = _fresh_template()
    load_checkpoint(tmp_path, template)
    for a, b in zip(net.state_dict().values(), net2.state_dict().values()):
        assert torch.equal(a, b)
