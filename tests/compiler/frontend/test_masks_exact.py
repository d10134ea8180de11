"""No silent mis-compile: attention masks are read exactly at the plan's length, a sliding window
is sliced exactly (and its KV cache bounded by the window), anything else is refused saying what
the mask is; the numeric self-check runs at the plan's length and names where slicing changes
the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tpc.compiler.frontend import SlicedModel, load_model
from tpc.compiler.frontend.model_file import import_model_file
from tpc.executors.oracle import reference_step
from tpc.executors.stage_runtime import StageRuntime
from tpc.ir.diagnostics import TpirError

from .harness import batch, simulated_kv_peaks, sliced_step, summed
from .hf_models import VOCAB, assert_grads_match, config_dict, hf_model

MODELS = Path(__file__).resolve().parent / "models"
SEQ = 16


def line_of(path: Path, needle: str) -> int:
    return next(i for i, t in enumerate(path.read_text().splitlines(), 1) if needle in t)


def exact(model, sm, lens, stages=2, rows=4, checkpoint=False, split=False):
    ids, targets = batch(sm.vocab, rows, sm.seq_len, seed=7)
    loss, per_stage = sliced_step(sm, sm.partition_by_params(stages), ids, targets, 2, lens,
                                  checkpoint=checkpoint, split_backward=split)
    ref_loss, ref = reference_step(model, ids, targets)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_grads_match(summed(per_stage), ref)


# ------------------------------------------------------------------ masks under a causal-looking construct

MASKED = import_model_file(str(MODELS / "masked.py"))


@pytest.mark.parametrize("width", [1, 2, 3, 7, 15, 16, 17, 40])
def test_a_banded_mask_is_sliced_exactly_at_its_width(width):
    """masked_fill with a band of `width` keys: a sliding window below the plan's length, plain
    causal at or above it; the sliced model is the model either way."""
    torch.manual_seed(0)
    model = MASKED.Masked("band", width)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=64)
    want = width if width < SEQ else None
    assert [s.window for s in sm._sites] == [want, want]
    exact(model, sm, [1, 2, 6, 7])


@pytest.mark.parametrize("width", [1, 3, 16])
def test_a_window_built_from_positions_for_sdpa_is_sliced_exactly(width):
    torch.manual_seed(0)
    model = MASKED.Windowed(width)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=64)
    assert [s.window for s in sm._sites] == [width if width < SEQ else None] * 2
    exact(model, sm, [5, 1, 10])


@pytest.mark.parametrize("kind,width", [("chunk", 4), ("document", 12)])
def test_a_chunked_mask_is_sliced_exactly(kind, width):
    """Chunks of `width` tokens (a document mask whose documents start every 12 tokens is the
    same mask, causal for the first 12 tokens: a check at a few tokens would not see the chunks):
    chunked local attention, each slice over its chunk's prefix, slices across chunk boundaries."""
    torch.manual_seed(0)
    model = MASKED.Masked(kind, width)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=64)
    assert [s.node.kwargs.get("chunk") for s in sm._sites] == [width, width]
    exact(model, sm, [1, 2, 6, 7])
    exact(model, sm, [5, 3, 8], stages=3)


@pytest.mark.parametrize("kind,width,words", [
    ("document", 5, "causal within documents (a document mask), which start at tokens 0, 5"),
    ("sink", 4, "causal with gaps: query 5 does not see the earlier key 1"),
    ("strided", 3, "causal with gaps"),
    ("future", 1, "not causal: query 0 sees the later key 1"),
])
def test_other_masks_are_refused_saying_what_they_are(kind, width, words):
    torch.manual_seed(0)
    with pytest.raises(TpirError) as info:
        SlicedModel.from_model(MASKED.Masked(kind, width), seq_len=SEQ, vocab=64)
    d = info.value.diagnostics[0]
    assert words in d.message and f"at the plan's length {SEQ}" in d.message and d.hint
    assert Path(d.loc.file).name == "masked.py" and d.loc.line == line_of(MODELS / "masked.py", "F.softmax(att")


# ------------------------------------------------------------------ Hugging Face sliding windows

def test_mistral_sliding_window_is_exact_not_causal():
    """The mis-compile of the issue: Mistral with sliding_window=16 trained at 32 tokens."""
    pytest.importorskip("transformers")
    model = hf_model("mistral", "sdpa", sliding_window=16)
    sm = SlicedModel.from_model(model, seq_len=32, vocab=VOCAB)
    assert [s.window for s in sm._sites] == [16, 16]
    exact(model, sm, [1, 15, 16], stages=3)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_mistral_window_smaller_than_slices_with_checkpoint_and_split_backward(impl):
    pytest.importorskip("transformers")
    model = hf_model("mistral", impl, sliding_window=5)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    assert [s.window for s in sm._sites] == [5, 5]
    exact(model, sm, [1, 1, 2, 12], stages=3)
    exact(model, sm, [3, 9, 1, 3], checkpoint=True, split=True)


def test_qwen2_mixes_full_and_windowed_layers():
    pytest.importorskip("transformers")
    model = hf_model("qwen2", "eager", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    assert [s.window for s in sm._sites] == [None, 4]
    exact(model, sm, [2, 7, 7])


def test_a_user_wrapper_with_the_generation_cache_on_compiles():
    """use_cache left on: Hugging Face's cache slices keys by the window, which export would
    guard; the capture turns it off and the model is unchanged."""
    pytest.importorskip("transformers")
    mod = import_model_file(str(MODELS / "hf_wrapper.py"))
    torch.manual_seed(0)
    settings = config_dict("mistral", sliding_window=4)
    model = mod.LM(settings.pop("model_type"), **settings)
    assert model.m.config.use_cache
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    assert model.m.config.use_cache  # restored
    assert [s.window for s in sm._sites] == [4, 4]
    exact(model, sm, [6, 10])


def test_opt_positions_are_computed_at_full_length():
    """OPT's positions are cumsum(attention_mask) - 1: not an arange the front end can shift, so
    they are computed at the plan's length and cut to each slice's window."""
    pytest.importorskip("transformers")
    sm = SlicedModel.from_model(hf_model("opt", "sdpa"), seq_len=SEQ, vocab=VOCAB)
    assert any(n.meta.get("tpc_kind") == "full-length" and "cumsum" in str(n.target) for n in sm._graph.nodes)


# ------------------------------------------------------------------ the windowed cache in the runtime

def test_windowed_kv_cache_and_its_gradients_are_bounded_by_the_window():
    """A windowed layer's buffers hold at most w - 1 tokens plus the longest slice, the
    gradients sent into them at most w - 1, and the stage's gradients are those of plain
    autograd (checked through the whole model above; here the runtime against itself with a
    full-length cache, which an unwindowed prefix gives)."""
    pytest.importorskip("transformers")
    window, lens = 4, [3, 1, 1, 2, 5, 4]
    model = hf_model("mistral", "sdpa", sliding_window=window)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    stage = sm.stage_module(1, 3)
    assert stage.kv_windows == [window] * 4

    def run(windows):
        stage.kv_windows = windows
        torch.manual_seed(1)
        xs = [torch.randn(2, n, sm.hidden_size) for n in lens]
        gs = [torch.randn(2, n, sm.hidden_size) for n in lens]
        for p in stage.parameters():
            p.grad = None
        rt = StageRuntime(stage, 1.0)
        held, acc, start = [], [], 0
        for i, x in enumerate(xs):
            rt.forward(0, i, x, start, capacity=SEQ)
            start += x.size(1)
            held.append(max(b.size(-2) for b in rt.kv_buffers(0)))
        gx = []
        for i in reversed(range(len(xs))):
            gx.append(rt.backward(0, i, gs[i]))
            grads = rt._caches[0].grad
            acc.append(max((a.g.size(-2) for a in grads if a is not None), default=0) if grads else 0)
        return gx, [p.grad.clone() for p in stage.parameters()], held, acc

    gx, gp, held, acc = run([window] * 4)
    assert max(held) <= window - 1 + max(lens) < SEQ and max(acc) <= window - 1
    gx_full, gp_full, held_full, _ = run([None] * 4)
    assert max(held_full) == SEQ
    for a, b in zip(gx + gp, gx_full + gp_full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_simulated_kv_memory_of_a_windowed_model_is_bounded_by_the_window(tmp_path):
    """tpc simulate's memory (the traced-graph cost model) charges a windowed layer's cache
    min(T, w - 1 + longest slice) tokens, a full one T."""
    pytest.importorskip("transformers")
    import json

    seq, slices, window = 64, 8, 8
    peaks = {}
    for name, w in (("windowed", window), ("full", None)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config_dict("mistral", sliding_window=w)))
        _, peaks[name] = simulated_kv_peaks(path, seq, slices, VOCAB)
    held = min(seq, window - 1 + seq // slices)
    for windowed, full in zip(peaks["windowed"], peaks["full"]):
        assert windowed == pytest.approx(full * held / seq)


# ------------------------------------------------------------------ what the self-check and refusals say

def test_the_self_check_names_the_first_value_that_differs():
    with pytest.raises(TpirError) as info:
        SlicedModel.from_model(load_model(str(MODELS / "token_pool.py")), seq_len=SEQ, vocab=64)
    d = info.value.diagnostics[0]
    assert "slicing changes the model's output" in d.message and "`avg_pool1d`" in d.message
    assert "slices [1, 7, 8]" in d.message
    assert Path(d.loc.file).name == "token_pool.py"
    assert d.loc.line == line_of(MODELS / "token_pool.py", "F.avg_pool1d(")


def test_the_self_check_runs_the_given_slices_at_the_plans_length():
    torch.manual_seed(0)
    sm = SlicedModel.from_model(MASKED.Masked("band", 5), seq_len=SEQ, vocab=64, check_slices=None)
    sm.check_slicing([1] * SEQ)
    with pytest.raises(ValueError):
        sm.check_slicing([4, 4])  # not the plan's length


def test_no_grad_regions_and_positions_from_one():
    """A rotary table under @torch.no_grad() (a grad-mode region in the export), a parameter read
    under no_grad (no gradient, as in autograd) and positions arange(1, T + 1)."""
    torch.manual_seed(0)
    model = load_model(str(MODELS / "nograd_positions.py"))
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=64)
    assert any(n.meta.get("tpc_kind") == "full-length" for n in sm._graph.nodes)
    ids, targets = batch(64, 4, SEQ)
    loss, per_stage = sliced_step(sm, [(0, sm.num_units)], ids, targets, 2, [1, 6, 9])
    ref_loss, ref = reference_step(model, ids, targets)
    grads = summed(per_stage)
    assert "gain" not in grads and float(ref["gain"].norm()) == 0.0  # no gradient either way
    grads["gain"] = torch.zeros_like(ref["gain"])
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_grads_match({k: v for k, v in grads.items() if k != "gain"}, {k: v for k, v in ref.items() if k != "gain"})


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_bidirectional_encoder_is_refused_at_the_library_line_with_its_module(impl):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    with pytest.raises(TpirError) as info:
        SlicedModel.from_model(load_model(str(MODELS / "hf_bert.py"), impl), seq_len=SEQ, vocab=64)
    main, note = info.value.diagnostics[:2]
    assert "bidirectional" in main.message and "`hf.bert.encoder.layer.0.attention.self`" in main.message
    assert "site-packages" in main.loc.file and "transformers" in main.loc.file and main.loc.line > 0
    assert note.severity == "note" and Path(note.loc.file).name == "hf_bert.py"
    assert note.loc.line == line_of(MODELS / "hf_bert.py", "# the user's own line")
    assert "hf_bert.py" in str(info.value) and "note:" in str(info.value)


def test_a_bidirectional_config_json_is_refused_at_the_library_line(tmp_path):
    pytest.importorskip("transformers")
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="bert", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)))
    with pytest.raises(TpirError) as info:
        SlicedModel.from_model(load_model(str(path)), seq_len=SEQ, vocab=64)
    d = info.value.diagnostics
    assert len(d) == 1 and "bidirectional" in d[0].message and "`bert.encoder.layer.0.attention.self`" in d[0].message
    assert "transformers" in d[0].loc.file
