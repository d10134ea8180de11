"""Hugging Face decoders (Llama, Qwen2, Mistral, Gemma, Phi-3, GPT-NeoX, OPT, GPT-2), each with
`attn_implementation="sdpa"` and `"eager"`, sliced into 2 and 3 stages with equal, unequal and
one-token slices: the same loss and gradients as plain autograd on the unsliced model.

Each (family, implementation) is captured once per module; the models are tiny (2 layers,
hidden 32, vocab 128, 16 tokens)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tpc.compiler.frontend import SlicedModel  # noqa: E402
from tpc.executors.oracle import reference_step  # noqa: E402

from .harness import batch, sliced_step, summed  # noqa: E402
from .hf_models import FAMILIES, IMPLS, VOCAB, assert_grads_match, hf_model  # noqa: E402
from tpc.ir.diagnostics import TpirError  # noqa: E402

SEQ, ROWS, MICROBATCHES = 16, 4, 2
SLICINGS = {"equal": [4, 4, 4, 4], "unequal": [5, 2, 9], "ones": [1, 1, 1, 13]}

_captured: dict = {}


def captured(family: str, impl: str):
    """(model, SlicedModel, ids, targets, reference loss, reference gradients), made once."""
    key = (family, impl)
    if key not in _captured:
        model = hf_model(family, impl)
        sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
        ids, targets = batch(VOCAB, ROWS, SEQ)
        _captured[key] = (model, sm, ids, targets, *reference_step(model, ids, targets))
    return _captured[key]


@pytest.fixture(scope="module", autouse=True)
def _drop_captures():
    yield
    _captured.clear()


@pytest.mark.parametrize("slicing", list(SLICINGS))
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_sliced_equals_autograd(family, impl, stages, slicing):
    model, sm, ids, targets, ref_loss, ref_grads = captured(family, impl)
    ranges = sm.partition_by_params(stages)
    assert len(ranges) == stages and ranges[-1][1] == sm.num_units
    loss, per_stage = sliced_step(sm, ranges, ids, targets, MICROBATCHES, SLICINGS[slicing])
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_grads_match(summed(per_stage), ref_grads)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_attention_becomes_a_cached_site(family, impl):
    """Both layers' attention is recognised (none left for the token-mixing rules), with the
    heads cached before a grouped-query repeat."""
    model, sm, *_ = captured(family, impl)
    assert len(sm._sites) == 2 and all(s.window is None for s in sm._sites)
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    assert [s.k.meta["val"].shape[1] for s in sm._sites] == [kv_heads, kv_heads]


@pytest.mark.parametrize("family,impl,windows", [
    ("gpt_neo", "eager", [None, 4]), ("falcon", "eager", [None, None]), ("falcon", "sdpa", [None, None]),
    ("qwen3", "eager", [None, None]), ("starcoder2", "sdpa", [4, 4]), ("starcoder2", "eager", [4, 4]),
])
def test_more_families_and_attention_forms_are_exact(family, impl, windows):
    """GPT-Neo's local layers (where(mask, scores, tensor(finfo.min))), Falcon's in-place scaled
    scores, Qwen3's per-head q/k norms, StarCoder2's sliding window."""
    model = hf_model(family, impl)
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    assert [s.window for s in sm._sites] == windows
    ids, targets = batch(VOCAB, ROWS, SEQ)
    loss, per_stage = sliced_step(sm, sm.partition_by_params(2), ids, targets, MICROBATCHES, [1, 6, 9])
    ref_loss, ref = reference_step(model, ids, targets)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_grads_match(summed(per_stage), ref)
