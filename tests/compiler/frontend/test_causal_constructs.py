"""Causal constructs beyond softmax attention, each written as its own code writes it: ALiBi
(hand-written, and Hugging Face BLOOM, MPT and Falcon from tiny configs), sinusoidal positions
computed per call with in-place writes, short causal convolutions (Mamba's and Hyena's forms,
LFM2 from a tiny config) and RWKV's token shift. Each is sliced into 2 and 3 stages with equal,
unequal and one-token slices: the loss and every gradient within 1e-5 of plain autograd. A
mixer that is not causal is refused naming the construct: op, module and line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tpc.compiler.frontend import SlicedModel, bias, load_model
from tpc.compiler.frontend import runtime_ops as ops
from tpc.executors.oracle import reference_step
from tpc.executors.stage_runtime import StageRuntime
from tpc.ir.diagnostics import TpirError

from .harness import batch, sliced_step, summed
from .hf_models import VOCAB, assert_grads_match, hf_model

MODELS = Path(__file__).resolve().parent / "models"
SEQ, ROWS, MICROBATCHES = 16, 4, 2
SLICINGS = {"equal": [4, 4, 4, 4], "unequal": [5, 2, 9], "ones": [1, 1, 1, 13]}


def _file(name: str, factory: str = "model"):
    def build():
        torch.manual_seed(0)
        return load_model(str(MODELS / name), factory)
    return build


def _hf(family: str, impl: str):
    def build():
        pytest.importorskip("transformers")
        return hf_model(family, impl)
    return build


CONSTRUCTS = {
    "alibi": _file("alibi.py"),
    "alibi-sdpa": _file("alibi.py", "sdpa"),
    "bloom": _hf("bloom", "eager"),
    "sinusoidal": _file("sinusoidal.py"),
    "short-conv": _file("short_conv.py"),
    "token-shift": _file("token_shift.py"),
}
_captured: dict = {}


def captured(name: str):
    """(model, SlicedModel, ids, targets, reference loss, reference gradients), made once."""
    if name not in _captured:
        model = CONSTRUCTS[name]()
        vocab = VOCAB if name == "bloom" else 64
        sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=vocab)
        ids, targets = batch(vocab, ROWS, SEQ)
        _captured[name] = (model, sm, ids, targets, *reference_step(model, ids, targets))
    return _captured[name]


@pytest.fixture(scope="module", autouse=True)
def _drop_captures():
    yield
    _captured.clear()


def exact(model, sm, lens, stages=2, checkpoint=False, split=False):
    ids, targets = batch(sm.vocab, ROWS, SEQ, seed=3)
    loss, per_stage = sliced_step(sm, sm.partition_by_params(stages), ids, targets, MICROBATCHES, lens,
                                  checkpoint=checkpoint, split_backward=split)
    ref_loss, ref = reference_step(model, ids, targets)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_grads_match(summed(per_stage), ref)


@pytest.mark.parametrize("slicing", list(SLICINGS))
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("construct", list(CONSTRUCTS))
def test_sliced_equals_autograd(construct, stages, slicing):
    model, sm, ids, targets, ref_loss, ref_grads = captured(construct)
    loss, per_stage = sliced_step(sm, sm.partition_by_params(stages), ids, targets, MICROBATCHES, SLICINGS[slicing])
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_grads_match(summed(per_stage), ref_grads)


# ------------------------------------------------------------------ position biases

@pytest.mark.parametrize("construct,kind", [("alibi", "relative"), ("alibi-sdpa", "relative"), ("bloom", "key")])
def test_each_alibi_keeps_the_smallest_table(construct, kind):
    """-slope * (i - j) depends on the distance only: one row per head; BLOOM's slope * j on the
    key only. Both attentions of the model carry one, in their scores' layout at batch 1."""
    _, sm, *_ = captured(construct)
    kinds = [s.node.kwargs.get("bias_kind") for s in sm._sites]
    assert kinds == [kind, kind]
    table = sm._fetch(sm._sites[0].node.kwargs["bias"].target)
    assert table.shape[-1] == SEQ and table.numel() <= 4 * SEQ  # 4 heads x L, never L x L


@pytest.mark.parametrize("kind", ["key", "relative", "full"])
@pytest.mark.parametrize("window", [None, 3])
def test_a_bias_table_rebuilds_every_slice_bottom_right(kind, window):
    """For every slice [c, c + l) over the keys it reads, the rebuilt bias is the length-L bias's
    rows c .. c + l - 1 and those keys, repeated over the batch as the model's (B * H) layout."""
    L, heads = 12, 3
    g = torch.Generator().manual_seed(0)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    slopes = torch.rand(heads, 1, 1, generator=g)
    full = {"key": slopes * j.expand(L, L), "relative": -slopes * (i - j),
            "full": torch.rand(heads, L, L, generator=g)}[kind]
    keep = (j <= i) & ((j > i - window) if window else True)
    table, found = bias.table_of(full, keep)
    assert found == kind
    for c, l in [(0, 12), (0, 1), (5, 1), (4, 5), (9, 3)]:
        lk = min(c, window - 1) + l if window else c + l
        got = ops.position_bias(table, found, c, l, lk, (2 * heads,))
        want = full[:, c:c + l, c + l - lk:c + l].repeat(2, 1, 1)
        seen = keep[c:c + l, c + l - lk:c + l]
        got = got.expand(want.shape)  # a key bias is one row, broadcast over the queries
        assert torch.equal(got[:, seen], want[:, seen])


@pytest.mark.parametrize("family,impl", [("mpt", "eager"), ("falcon_alibi", "sdpa")])
def test_more_alibi_families_are_exact(family, impl):
    """MPT's bias sliced from a max_seq_len table, Falcon's ALiBi passed to SDPA in a float mask."""
    pytest.importorskip("transformers")
    model = hf_model(family, impl)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    assert [s.node.kwargs.get("bias_kind") for s in sm._sites] == ["key", "key"]
    exact(model, sm, [1, 6, 9], stages=3)


def test_a_learned_attention_bias_is_refused_naming_it():
    with pytest.raises(TpirError) as info:
        SlicedModel.from_model(_file("noncausal_mixers.py", "learned_bias")(), seq_len=SEQ, vocab=64)
    d = info.value.diagnostics[0]
    assert "learned position bias" in d.message and "(in `mix`, Mixer)" in d.message
    assert Path(d.loc.file).name == "noncausal_mixers.py" and d.hint


# ------------------------------------------------------------------ positions computed per call

def test_per_call_sinusoidal_positions_are_windowed_not_recomputed():
    """The table's writes become slice_scatter of windowed sines: a slice computes its own rows
    (no full-length work), for strided-slice and index_put writes alike."""
    _, sm, *_ = captured("sinusoidal")
    kinds = [n.meta.get("tpc_kind") for n in sm._graph.nodes]
    assert "full-length" not in kinds and "position" in kinds
    assert sum(n.target is torch.ops.aten.slice_scatter.default for n in sm._graph.nodes) == 2
    model = _file("sinusoidal.py", "indexed")()
    indexed = SlicedModel.from_model(model, seq_len=SEQ, vocab=64)
    assert sum(n.target is torch.ops.aten.index_put.default for n in indexed._graph.nodes) == 2
    exact(model, indexed, [3, 1, 12])


class _WrittenAlongTheSequence(torch.nn.Module):
    """Positions marked by writing rows: the write is along the sequence, so the table is
    computed at the plan's length and cut to each slice."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)

    def forward(self, ids):
        T = ids.size(1)
        marks = torch.zeros(T, 8)
        marks[T // 2:] = 1.0  # the second half of the sequence
        return self.head(self.emb(ids) + marks)


def test_positions_written_along_the_sequence_are_computed_at_full_length():
    torch.manual_seed(0)
    model = _WrittenAlongTheSequence()
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=64)
    assert any(n.meta.get("tpc_kind") == "full-length" for n in sm._graph.nodes)
    exact(model, sm, [5, 1, 10], stages=1)


# ------------------------------------------------------------------ causal state across slices

def test_short_convolutions_carry_their_last_inputs():
    """Each Mamba-style convolution of kernel 4 carries the last 3 tokens of its input (a window
    of 4); the memory model charges them as such a cache."""
    _, sm, *_ = captured("short-conv")
    assert [s.window for s in sm._states] == [4, 4] and [s.window for s in sm._sites] == [None]
    assert sm.unit_kv[1] == [(32, 4)] and sm.unit_kv[3] == [(32, 4)]  # d = 32 channels per token
    from tpc.compiler.costmodel.devices import H100
    from tpc.compiler.costmodel.graph import GraphCostModel, GraphCosts

    costs = GraphCostModel(H100, GraphCosts.from_sliced(sm, float_bytes=2), [(0, 2), (2, 5)])
    lens = (1, 2, 5, 8)
    assert sum(costs.kv_slice_bytes(0, lens, 4)) == 32 * min(SEQ, 3 + 8) * 4 * 2  # one windowed cache
    assert sum(costs.kv_slice_bytes(1, lens, 4)) == (32 * min(SEQ, 3 + 8) + sm.unit_kv_elements[2] * SEQ) * 4 * 2


@pytest.mark.parametrize("checkpoint,split", [(False, False), (True, True)])
def test_a_kernel_longer_than_the_slices_is_exact(checkpoint, split):
    """Kernel 7: a slice reads the last 6 tokens, which span up to six earlier slices."""
    model = _file("short_conv.py", "long_kernel")()
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=64)
    assert [s.window for s in sm._states] == [7, 7]
    exact(model, sm, [1, 1, 2, 1, 3, 8], stages=3, checkpoint=checkpoint, split=split)


def test_the_carried_state_and_its_gradients_stay_within_the_window():
    """The runtime keeps k - 1 tokens plus the slice of a convolution's input, and collects the
    gradients later slices send into it in at most k - 1 tokens."""
    _, sm, *_ = captured("short-conv")
    stage = sm.stage_module(1, 2)
    assert stage.kv_windows == [4] and stage.kv_dims == [2]
    lens = [1, 1, 2, 5, 7]
    rt = StageRuntime(stage, 1.0)
    torch.manual_seed(1)
    held, start = [], 0
    for i, n in enumerate(lens):
        rt.forward(0, i, torch.randn(2, n, sm.hidden_size), start, capacity=SEQ)
        start += n
        held.append(rt.kv_buffers(0)[0].size(2))
    got = []
    for i in reversed(range(len(lens))):
        rt.backward(0, i, torch.randn(2, lens[i], sm.hidden_size))
        got.append(rt._caches[0].grad[0].g.size(2) if rt._caches[0].grad and rt._caches[0].grad[0] else 0)
    assert max(held) <= 3 + max(lens) < SEQ and max(got) <= 3


def test_hyena_and_lfm2_convolutions_are_exact():
    """The padded form (F.pad(x, (k - 1, 0)), a valid conv1d) and Hugging Face LFM2's
    Conv1d(padding=k - 1)[..., :T] beside grouped-query attention."""
    model = _file("short_conv.py", "hyena")()
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=64)
    assert [s.window for s in sm._states] == [3, 3]
    exact(model, sm, [2, 1, 13], stages=3)
    pytest.importorskip("transformers")
    model = hf_model("lfm2", "sdpa")
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    assert [s.window for s in sm._states] == [3]
    exact(model, sm, [1, 6, 9])


def test_rwkv_token_shift_carries_one_token():
    _, sm, *_ = captured("token-shift")
    assert [s.window for s in sm._states] == [2, 2, 2, 2]  # two shifts per block, one token each


@pytest.mark.parametrize("factory,op,words,line", [
    ("centred", "conv1d", "depends on up to 1 later token", "self.conv(x.transpose(1, 2))"),
    ("lookahead", "pad", "depends on up to 1 later token", "return x + F.pad(x[:, 1:]"),
    ("replicate", None, "a `replicate` pad along the sequence", "mode=\"replicate\""),
])
def test_a_mixer_that_is_not_causal_is_refused_naming_it(factory, op, words, line):
    with pytest.raises(TpirError) as info:
        SlicedModel.from_model(_file("noncausal_mixers.py", factory)(), seq_len=SEQ, vocab=64)
    d = info.value.diagnostics[0]
    assert words in d.message and "(in `mix" in d.message and d.hint
    if op:
        assert f"`{op}`" in d.message and "not causal" in d.message
    path = MODELS / "noncausal_mixers.py"
    assert Path(d.loc.file).name == path.name
    assert d.loc.line == next(i for i, t in enumerate(path.read_text().splitlines(), 1) if line in t)


class _BufferPositions(torch.nn.Module):
    """Positions written into a buffer in forward (and a call counter): the table keeps its
    value from one call to the next, which slices do not repeat."""

    def __init__(self, read_back: bool):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)
        self.register_buffer("pe", torch.zeros(SEQ, 8))
        self.register_buffer("calls", torch.zeros(()))
        self.read_back = read_back

    def forward(self, ids):
        T = ids.size(1)
        self.calls += 1  # never read: harmless
        if not self.read_back:
            return self.head(self.emb(ids))
        self.pe[:T, 0] = torch.arange(T).float()
        return self.head(self.emb(ids) + self.pe[:T])


def test_a_write_into_a_buffer_the_forward_reads_back_is_refused_at_its_line():
    torch.manual_seed(0)
    SlicedModel.from_model(_BufferPositions(read_back=False), seq_len=SEQ, vocab=64)
    with pytest.raises(TpirError) as info:
        SlicedModel.from_model(_BufferPositions(read_back=True), seq_len=SEQ, vocab=64)
    d = info.value.diagnostics[0]
    assert "in-place write into the parameter or buffer `pe`" in d.message and d.hint
    assert Path(d.loc.file).name == Path(__file__).name
    assert d.loc.line == next(i for i, t in enumerate(Path(__file__).read_text().splitlines(), 1)
                              if "self.pe[:T, 0] = " in t)
