"""Two real processes over gloo (`DistGroup`, a torch.distributed process group): nanoGPT split
over T = 2 tensor ranks, each process one rank, matches plain autograd."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T = 2
L = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out_dir: str) -> None:
    from tests.compiler.frontend.harness import batch, tiny_model
    from tpc.compiler.frontend import SlicedModel
    from tpc.compiler.tensor import DistGroup, shard_stage

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=T)
    try:
        m = tiny_model("nanogpt")
        vocab = int(m(torch.zeros(1, 1, dtype=torch.long)).shape[-1])
        sm = SlicedModel.from_model(m, seq_len=L, vocab=vocab, check_slices=None)
        ids, targets = batch(vocab, 2, L)
        stage = shard_stage(sm, 0, sm.num_units, T, rank, DistGroup())
        y, _ = stage(ids, 0, stage.empty_kv(2), targets)
        loss = y / targets.numel()
        loss.backward()
        grads = {n: p.grad for n, p in stage.named_parameters()}
        torch.save({"loss": float(loss.detach()), "grads": grads, "shards": stage.shards},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_match_autograd(tmp_path):
    from tests.compiler.frontend.harness import batch, tiny_model
    from tests.compiler.frontend.hf_models import assert_grads_match
    from tpc.executors.oracle import reference, relative_error

    mp.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=T, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(T)]
    m = tiny_model("nanogpt")
    vocab = int(m(torch.zeros(1, 1, dtype=torch.long)).shape[-1])
    ids, targets = batch(vocab, 2, L)
    ref = reference(m, ids, targets)
    shards = got[0]["shards"]
    grads = {n: shards[n].join([g["grads"][n] for g in got]) for n in shards}
    for g in got:
        assert relative_error(torch.tensor(g["loss"]), torch.tensor(ref.loss)) <= 1e-5
    assert_grads_match(grads, ref.grads)
    # a split parameter's slices differ between the ranks; a replicated one's gradients agree
    wte = "transformer.wte.weight"
    assert got[0]["grads"][wte].shape[0] * 2 == ref.grads[wte].shape[0]
    ln = "transformer.h.0.ln_1.weight"
    torch.testing.assert_close(got[0]["grads"][ln], got[1]["grads"][ln])
