"""Two token slices of a tensor-parallel stage as one program (`compiler/tensor/overlap.py`):
each slice's collectives are started and waited on where their values are read, the other
slice computing in between; loss and gradients equal, bit for bit, those of the slices run one
after the other."""

from __future__ import annotations

import pytest
import torch

from tests.compiler.frontend.harness import batch, tiny_model
from tests.compiler.frontend.hf_models import VOCAB, hf_model
from tests.compiler.tensor.tp_harness import sliced_step
from tpc.compiler.frontend import SlicedModel
from tpc.compiler.tensor import collectives
from tpc.compiler.tensor.overlap import paired_program

L = 16


def _sliced(name):
    if name.startswith("hf-"):
        m, vocab = hf_model(name[3:], "sdpa"), VOCAB
    else:
        m = tiny_model(name)
        vocab = int(m(torch.zeros(1, 1, dtype=torch.long)).shape[-1])
    return SlicedModel.from_model(m, seq_len=L, vocab=vocab, check_slices=None), vocab


@pytest.mark.parametrize("name", ["nanogpt", "hf-llama", "hf-gpt2"])
@pytest.mark.parametrize("sequence", [False, True])
def test_a_pair_of_slices_computes_what_the_two_slices_compute(name, sequence):
    sm, vocab = _sliced(name)
    ids, targets = batch(vocab, 2, L)
    ranges = [(0, 2), (2, sm.num_units)]
    lens = [4, 2, 6, 4]  # two pairs: the first at the micro-batch's start, the second after cached tokens
    one_by_one = sliced_step(sm, ranges, ids, targets, lens, 2, sequence=sequence, capacity=L)
    paired = sliced_step(sm, ranges, ids, targets, lens, 2, pairs=True, sequence=sequence, capacity=L)
    assert one_by_one[0] == paired[0]
    assert one_by_one[1].keys() == paired[1].keys()
    for n, g in one_by_one[1].items():
        assert torch.equal(g, paired[1][n]), n


def test_a_pair_grows_its_cache_when_the_capacity_is_not_known():
    sm, vocab = _sliced("nanogpt")
    ids, targets = batch(vocab, 2, L)
    ranges = [(0, 2), (2, sm.num_units)]
    one_by_one = sliced_step(sm, ranges, ids, targets, [3, 5, 8], 2)
    paired = sliced_step(sm, ranges, ids, targets, [3, 5, 8], 2, pairs=True)
    assert one_by_one[0] == paired[0]
    for n, g in one_by_one[1].items():
        assert torch.equal(g, paired[1][n]), n


def test_each_slice_s_collectives_are_started_before_the_other_slice_computes():
    """The program's order: a collective of one slice is started, nodes of the other slice
    run, and only then is it waited on; slice b reads its prefix after slice a wrote it."""
    from tpc.compiler.tensor import shard_stage, thread_groups

    sm, _ = _sliced("nanogpt")
    stage = shard_stage(sm, 1, sm.num_units - 1, 2, 0, thread_groups(2)[0])
    g = paired_program(stage.graph, stage.num_kv)
    order = list(g.nodes)
    started = set(collectives.STARTED.values())
    starts = [n for n in order if n.target in started]
    assert len(starts) == 2 * sum(1 for n in stage.graph.nodes if n.target in collectives.STARTED) > 0
    slice_of = {}
    for n in order:  # which slice a node computes for: by the placeholders it depends on
        if n.op == "placeholder":
            slice_of[n] = n.name[0] if n.name != "cache" else None
        else:
            tags = {slice_of.get(a) for a in n.all_input_nodes} - {None}
            slice_of[n] = tags.pop() if len(tags) == 1 else ("a" if n.op == "call_method" else None)
    overlapped = 0
    for s in starts:
        pending = next(u for u in s.users if u.args[1] == 1)
        wait = next(u for u in pending.users if u.target is collectives.wait)
        between = order[order.index(s) + 1:order.index(wait)]
        if any(slice_of.get(n) not in (None, slice_of[s]) for n in between if n.op == "call_function"):
            overlapped += 1
    assert overlapped >= len(starts) - 2, (overlapped, len(starts))
    writes = [n for n in order if n.op == "call_method" and n.target == "write"]
    reads = [n for n in order if n.op == "call_method" and n.target == "prefix"]
    assert len(writes) == len(reads) == stage.num_kv
    for r in reads:
        first_use = min(order.index(u) for u in r.users)
        write = next(w for w in writes if w.args[1] == r.args[1])
        assert order.index(write) < order.index(r) < first_use
