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


@pytest.mark.parametrize("name,sequence", [("nanogpt", False), ("hf-llama", True)])
def test_pairs_of_traced_programs_forward_and_backward_compute_what_the_slices_compute(name, sequence):
    """Through the stages' traced programs: the forwards of slices i, i + 1 as one program, and
    the backwards of i + 1, i as one (b's prefix gradients handed to a's upstream gradients layer
    by layer); loss and gradients equal, bit for bit, the slices run one by one, eagerly."""
    sm, vocab = _sliced(name)
    ids, targets = batch(vocab, 2, L)
    ranges = [(0, 2), (2, sm.num_units)]
    lens = [4, 2, 6, 4]
    one_by_one = sliced_step(sm, ranges, ids, targets, lens, 2, sequence=sequence, capacity=L)
    paired = sliced_step(sm, ranges, ids, targets, lens, 2, pairs=True, sequence=sequence, capacity=L,
                         programs=True)
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
    assert _overlapped(order, starts, writer="a") >= len(starts) - 2
    assert _handed_over_in_order(order) == stage.num_kv


def _overlapped(order, starts, writer: str | None = None) -> int:
    """Of the started collectives, how many have a node of the other slice computing between
    their start and their wait. A node's slice: by the placeholders (named a_..., b_...) it
    depends on; a call of the cache's methods is `writer`'s."""
    slice_of = {}
    for n in order:
        if n.op == "placeholder":
            slice_of[n] = n.name[0] if n.name != "cache" else None
        else:
            tags = {slice_of.get(a) for a in n.all_input_nodes} - {None}
            slice_of[n] = tags.pop() if len(tags) == 1 else (writer if n.op == "call_method" else None)
    overlapped = 0
    for s in starts:
        pending = next(u for u in s.users if u.args[1] == 1)
        wait = next(u for u in pending.users if u.target is collectives.wait)
        between = order[order.index(s) + 1:order.index(wait)]
        overlapped += any(slice_of.get(n) not in (None, slice_of[s]) for n in between if n.op == "call_function")
    return overlapped


def _handed_over_in_order(order) -> int:
    """Each value the first slice writes into the cache is written before the second slice
    reads it, and read before its first use; returns how many were handed over."""
    writes = [n for n in order if n.op == "call_method" and n.target == "write"]
    reads = [n for n in order if n.op == "call_method" and n.target == "prefix"]
    assert len(writes) == len(reads)
    for r in reads:
        first_use = min(order.index(u) for u in r.users)
        write = next(w for w in writes if w.args[1] == r.args[1])
        assert order.index(write) < order.index(r) < first_use
    return len(reads)


def test_a_pair_of_backward_programs_starts_each_collective_before_the_other_slice_computes():
    """The backward pair's order: slice b = i + 1 runs first; each collective of either slice
    (f's all-reduce of an input gradient, ...) is started, nodes of the other slice run, then it
    is waited on; b's gradient of its prefix t is written into the cache before a's upstream
    gradient t is read from it, and that before a reads it."""
    from tpc.compiler.tensor import overlap

    sm, vocab = _sliced("nanogpt")
    ids, targets = batch(vocab, 2, L)
    made = []
    original = overlap.paired_programs

    def recorded(first, second, handover, tags=("a", "b")):
        made.append((first, second, handover, tags, original(first, second, handover, tags=tags)))
        return made[-1][-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(overlap, "paired_programs", recorded)
        sliced_step(sm, [(0, 2), (2, sm.num_units)], ids, targets, [4, 4, 4, 4], 2, pairs=True, capacity=L,
                    programs=True)
    backwards = [m for m in made if m[3] == ("b", "a")]
    assert backwards  # every stage's backward pairs, on each rank
    started = set(collectives.STARTED_OPS.values())
    for first, second, handover, _, gm in backwards:
        order = list(gm.graph.nodes)
        ops = [n for g in (first, second) for n in g.graph.nodes if n.target in collectives.STARTED_OPS]
        starts = [n for n in order if n.target in started]
        assert len(starts) == len(ops) > 0
        assert _overlapped(order, starts) >= len(starts) - 1  # (nanoGPT's: all of them)
        assert _handed_over_in_order(order) == len(handover) > 0  # one per cached tensor of the stage


def test_an_evaluation_pair_of_forward_only_programs_computes_what_the_slices_compute():
    """`evaluate_pair` on a stage run through its programs: the forward-only programs of two
    slices as one; the outputs equal, bit for bit, the slices evaluated one by one."""
    from tests.compiler.tensor.tp_harness import on_threads, rank_stages
    from tpc.compiler.programs.stage_programs import StagePrograms
    from tpc.executors.stage_runtime import StageRuntime

    sm, vocab = _sliced("nanogpt")
    ids, targets = batch(vocab, 2, L)
    lens, offsets = [4, 4, 4, 4], [0, 4, 8, 12]
    outs = {}
    for pairs in (False, True):
        stages = rank_stages(sm, [(0, 2), (2, sm.num_units)], 2)

        def run(r, pairs=pairs, stages=stages):
            runtimes = [StageRuntime(m, 1.0, StagePrograms(m)) for m in stages[r]]
            acts = {}
            for s, rt in enumerate(runtimes):
                def inputs(i, s=s, rt=rt):
                    x = ids[:, offsets[i]:offsets[i] + lens[i]] if s == 0 else acts[(s - 1, i)]
                    return x, offsets[i], targets[:, offsets[i]:offsets[i] + lens[i]] if rt.module.is_last else None
                for i in range(0, len(lens), 2 if pairs else 1):
                    if pairs:
                        (xa, oa, ta), (xb, ob, tb) = inputs(i), inputs(i + 1)
                        acts[(s, i)], acts[(s, i + 1)] = rt.evaluate_pair(0, i, (xa, xb), (oa, ob), (ta, tb), L)
                    else:
                        x, o, t = inputs(i)
                        acts[(s, i)] = rt.evaluate(0, i, x, o, t, capacity=L)
            return [acts[(1, i)] for i in range(len(lens))]  # the last stage's scaled losses

        outs[pairs] = on_threads(2, run)
    for a, b in zip(outs[False], outs[True]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
