"""`tpc profile` measures what a slice's forward keeps for its backward (the stash), and the
profiled cost model prices it for the memory model: a one-layer GPT of width 16, profiled at
L = 16 for micro-batch sizes 1 and 3 (2 is priced between them, 4 beyond them)."""

from __future__ import annotations

import msgpack
import pytest
import torch

from tpc.cli.compile import check_options
from tpc.compiler.compile import compile_plan
from tpc.compiler.frontend import read_vocab
from tpc.compiler.costmodel import load_cost_model
from tpc.compiler.costmodel.base import CostModel
from tpc.compiler.costmodel.store import PROFILE_VERSION
from tpc.compiler.frontend import SlicedModel, load_model
from tpc.compiler.predict.memory import rank_memory
from tpc.executors.stage_runtime import StageRuntime
from tests.compiler.costmodel.tiny_model import L, SIZES, refusals


@pytest.fixture(scope="module")
def tiny(tiny_profile):
    """The shared profile (conftest.py), with the traced model."""
    src = tiny_profile["src"]
    model = load_model(str(src), "model")
    vocab = read_vocab(model, str(src))
    sliced = SlicedModel.from_model(model, seq_len=L, vocab=vocab)
    return dict(tiny_profile, sliced=sliced, vocab=vocab)


def saved_bytes(sliced, vocab, lo, hi, l, c, b) -> int:
    """Bytes autograd saves in one forward of units [lo, hi) as one stage (a slice of l tokens
    after c), counted independently of the profiler: distinct storages of the saved tensors,
    less the parameters and the bytes of the KV cache."""
    torch.manual_seed(0)
    stage = sliced.stage_module(lo, hi)
    rt = StageRuntime(stage, 1.0)

    def inputs(n):
        x = (torch.randint(0, vocab, (b, n)) if stage.is_first
             else torch.randn(b, n, sliced.hidden_size))
        return x, (torch.randint(0, vocab, (b, n)) if stage.is_last else None)

    sl = 0
    if c:
        rt.forward(0, 0, *inputs(c)[:1], 0, inputs(c)[1])
        sl = 1
    saved = []
    x, tg = inputs(l)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rt.forward(0, sl, x, c, tg)
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    for ptr in params:
        storages.pop(ptr, None)
    for k in rt.kv_buffers(0):  # the cache's own bytes are kv_bytes
        ptr = k.untyped_storage().data_ptr()
        if ptr in storages:
            storages[ptr] -= k.numel() * k.element_size()
    return sum(storages.values())


@pytest.mark.parametrize("l, c, b", [(5, 6, 2), (12, 3, 2), (3, 0, 2), (6, 7, 4)])
def test_profiled_stash_matches_a_direct_measurement_off_the_grid(tiny, l, c, b):
    """Lengths 3, 5, 6, 12 and these contexts were never measured; b = 2 lies between the
    measured sizes, b = 4 beyond them."""
    prof = tiny["profile"]
    n = prof.num_units
    cm = load_cost_model(cost=str(tiny["path"]), stage_units=[(0, n)])
    direct = saved_bytes(tiny["sliced"], tiny["vocab"], 0, n, l, c, b)
    assert direct > 10 * cm.activation_bytes(l, b)
    assert cm.stash_bytes(0, l, c, b) == pytest.approx(direct, rel=0.15)


def test_stash_fits_are_stored_and_tight(tiny):
    prof = tiny["profile"]
    assert prof.version == PROFILE_VERSION
    for u in prof.units:
        assert len(u.stash) == len(SIZES) and all(min(f.coef) >= 0 for f in u.stash)
        assert len(u.stash_samples) == len(u.samples)
    assert 0 < prof.worst_stash_error < 0.05


def test_stash_grows_with_length_and_context_and_dwarfs_the_boundary(tiny):
    n = tiny["profile"].num_units
    cm = load_cost_model(cost=str(tiny["path"]), stage_units=[(0, 1), (1, n - 1), (n - 1, n)])
    block = 1
    for b in (1, 2, 3, 4):
        by_length = [cm.stash_bytes(block, l, 0, b) for l in (1, 2, 4, 7, 8, 16)]
        assert by_length == sorted(by_length) and len(set(by_length)) == len(by_length)
        by_context = [cm.stash_bytes(block, 4, c, b) for c in (0, 1, 4, 6, 12)]
        assert by_context == sorted(by_context) and len(set(by_context)) == len(by_context)
        for l in (1, 4, 16):
            assert cm.stash_bytes(block, l, L - l, b) > 10 * cm.activation_bytes(l, b)
    # micro-batch sizes: more rows keep more
    assert cm.stash_bytes(block, 8, 8, 1) < cm.stash_bytes(block, 8, 8, 2) < cm.stash_bytes(block, 8, 8, 3)


class BoundaryOnly(CostModel):
    """The same cost model without its own `stash_bytes` (the base class's: the boundary
    activation): what the memory model had before."""

    def __init__(self, inner):
        self.inner = inner

    def slice_time(self, stage, l, c, mb_size):
        return self.inner.slice_time(stage, l, c, mb_size)

    def p2p_time(self, nbytes):
        return self.inner.p2p_time(nbytes)

    def activation_bytes(self, l, mb_size):
        return self.inner.activation_bytes(l, mb_size)

    def kv_bytes(self, stage, l, mb_size):
        return self.inner.kv_bytes(stage, l, mb_size)

    def param_bytes(self, stage):
        return self.inner.param_bytes(stage)


def test_rank_memory_of_a_profiled_plan_counts_the_stash(tiny):
    plan = compile_plan(str(tiny["src"]), check_options(stages="2", microbatches=2, seq_len=L, batch=2,
                        slices="4", schedule="seq1f1b", cost=str(tiny["path"]), quiet=True))
    stages = [s.units for s in plan.header.stages]
    cm = load_cost_model(cost=str(tiny["path"]), stage_units=stages)
    most, peaks = {}, {}
    for prog in plan.ranks:
        with_stash = rank_memory(plan.header, prog.rank, prog.instrs, cm).during
        boundary = rank_memory(plan.header, prog.rank, prog.instrs, BoundaryOnly(cm)).during
        # parameters and KV caches do not depend on the stash, instruction by instruction (the
        # peaks may fall on different instructions, so they are not compared)
        assert [(m.params, m.kv) for m in with_stash] == [(m.params, m.kv) for m in boundary]
        most[prog.rank] = (max(m.activations for m in with_stash),
                           max(m.activations for m in boundary))
        peaks[prog.rank] = (max(m.total for m in with_stash), max(m.total for m in boundary))
    # the rank holding the decoder block keeps far more than the activation it sends on (an
    # embedding-only stage keeps less: its ids, not its output)
    block_rank = next(s.rank for s in plan.header.stages if s.units[0] <= 1 < s.units[1])
    with_stash, boundary = most[block_rank]
    assert with_stash > 5 * boundary > 0
    # what --memory-per-rank compares: the largest peak of any rank
    assert max(w for w, _ in peaks.values()) > max(b for _, b in peaks.values())


def test_an_older_profile_is_refused_with_the_command_to_rerun(tiny, tmp_path):
    obj = msgpack.unpackb(tiny["path"].read_bytes(), raw=False)
    obj["version"] = 1
    for u in obj["units"]:  # what version 1 wrote
        u.pop("stash", None)
        u.pop("stash_samples", None)
    old = tmp_path / "old.msgpack"
    old.write_bytes(msgpack.packb(obj, use_bin_type=True))
    for text in refusals(old):
        assert "stale" in text and "version 1" in text
        assert f"tpc profile {tiny['src']} -o {old} --seq-len {L} --batch-sizes 1,3" in text
