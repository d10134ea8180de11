"""Random layerwise token dropping in the stage graphs (compiler/frontend/random_ltd.py) against
its plain-PyTorch oracle (executors/random_ltd_oracle.py): the model's own blocks run on the kept
tokens of whole sequences. Stage modules with dropped units, run slice by slice over their KV
caches (a dropped unit's cache holds its kept tokens only) and across a stage cut, give the
oracle's loss and gradients (<= 1e-5) on nanoGPT (examples/nanogpt.py) and a Hugging Face Llama
(RoPE: positions gathered with the tokens), unsliced and sliced (equal and unequal slices), and
the loss differs from the model's without dropping."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.compiler.frontend.hf_models import hf_model
from tests.executors.real import model_file
from tpc.compiler.frontend import SlicedModel, load_model
from tpc.compiler.frontend.model_file import read_vocab
from tpc.compiler.random_ltd import RandomLTD, from_flags, parse_units
from tpc.executors.oracle import gradient_error, reference
from tpc.executors.random_ltd_oracle import ltd_reference
from tpc.ir.diagnostics import TpirError

SEQ, ROWS, MBS, TOL = 16, 2, 2, 1e-5


def nanogpt():
    torch.manual_seed(0)
    path = model_file("nanogpt")
    model = load_model(path, "model")
    return model, read_vocab(model, path)


def llama():
    return hf_model("llama", "sdpa", num_hidden_layers=3), 128


MODELS = {"nanogpt": nanogpt, "hf-llama": llama}


@pytest.fixture(scope="module", params=sorted(MODELS))
def built(request):
    model, vocab = MODELS[request.param]()
    return request.param, model, SlicedModel.from_model(model, seq_len=SEQ, vocab=vocab)


def run_stages(sliced, ranges, ltd, step, tokens, lengths):
    """Loss and gradients of stage modules `ranges` run micro-batch by micro-batch, slice by
    slice, each stage reading its own KV caches; every micro-batch cut into `lengths`."""
    mods = [sliced.stage_module(lo, hi, dropped=ltd.units) for lo, hi in ranges]
    total = None
    for m in range(MBS):
        rows = tokens[m * ROWS:(m + 1) * ROWS]
        ids, targets = rows[:, :-1], rows[:, 1:]
        keeps = ltd.micro_batch(step, 0, m, lengths)
        caches = [mod.empty_kv(ROWS) for mod in mods]
        off = 0
        for i, n in enumerate(lengths):
            x = ids[:, off:off + n]
            for s, mod in enumerate(mods):
                keep = [keeps[u][i] for u in mod.dropped]
                extra = (targets[:, off:off + n],) if mod.has_loss else ()
                x, kv = mod(x, off, caches[s], *extra, keep=keep)
                caches[s] = [torch.cat([p, k], dim=d) for p, k, d in zip(caches[s], kv, mod.kv_dims)]
            total = x if total is None else total + x
            off += n
    loss = total / tokens[:, 1:].numel()
    params = [(n, p) for n, p in sliced.model.named_parameters()]
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return float(loss.detach()), {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params, grads)}


@pytest.mark.parametrize("lengths", [(16,), (8, 8), (3, 9, 4)])
def test_stages_match_the_plain_pytorch_oracle(built, lengths):
    name, model, sliced = built
    last = sliced.num_units - 1
    units = (1, last - 1) if last > 3 else (1,)  # nanoGPT: h.0 of h.0, h.1; Llama: layers 0 and 2 of 3
    ltd = RandomLTD(units=units, min_value=5, max_value=13, require_steps=4, seq_per_step=2)
    step = 1  # kept 7 of 16
    tokens = torch.randint(0, sliced.vocab, (MBS * ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    oracle = ltd_reference(copy.deepcopy(model), tokens, ltd, sliced.unit_labels, step,
                           [(m * ROWS, ROWS, 0, lengths) for m in range(MBS)])
    plain = reference(copy.deepcopy(model), tokens[:, :-1], tokens[:, 1:])
    assert abs(oracle.loss - plain.loss) > 1e-4  # dropping changed the model's output
    for ranges in ([(0, sliced.num_units)], [(0, 2), (2, sliced.num_units)]):
        loss, grads = run_stages(sliced, ranges, ltd, step, tokens, lengths)
        assert abs(loss - oracle.loss) <= TOL * abs(oracle.loss), (ranges, loss, oracle.loss)
        worst, where = gradient_error(grads, oracle.grads, oracle.unused)
        assert worst <= TOL, (ranges, worst, where)


def test_a_dropped_units_cache_holds_its_kept_tokens_only(built):
    name, model, sliced = built
    ltd = RandomLTD(units=(1,), min_value=3, max_value=3, require_steps=1)
    mod = sliced.stage_module(0, sliced.num_units, with_loss=False, dropped=(1,))
    plain = sliced.stage_module(0, sliced.num_units, with_loss=False)
    ids = torch.randint(0, sliced.vocab, (ROWS, 8))
    keep = ltd.micro_batch(0, 0, 0, (8,))
    _, kv = mod(ids, 0, mod.empty_kv(ROWS), keep=[keep[1][0]])
    _, full = plain(ids, 0, plain.empty_kv(ROWS))
    sizes = [k.size(d) for k, d in zip(kv, mod.kv_dims)]
    # unit 1's keys and values come first: 3 kept tokens; every other unit's, all 8
    assert sizes[:2] == [3, 3] and set(sizes[2:]) == {8}
    assert [k.size(d) for k, d in zip(full, plain.kv_dims)] == [8] * len(full)
    # keeping every token is the model without dropping
    y, _ = mod(ids, 0, mod.empty_kv(ROWS))
    y0, _ = plain(ids, 0, plain.empty_kv(ROWS))
    assert torch.allclose(y, y0, atol=1e-6)


def test_the_kept_count_follows_deepspeeds_fixed_linear_schedule():
    ltd = RandomLTD(units=(1,), min_value=128, max_value=2048, require_steps=100, seq_per_step=16)
    assert [ltd.kept(s) for s in (0, 1, 50, 99, 100, 1000)] == [128, 144, 1088, 2016, 2048, 2048]
    # a slice keeps its share, at least one token
    assert ltd.slice_counts(7, (8, 8)) == [3, 4] and ltd.slice_counts(7, (3, 9, 4)) == [1, 4, 2]
    assert ltd.slice_counts(2, (1, 1, 14)) == [1, 1, 2]  # at least one each: 4 in all
    a = ltd.keep(3, 0, 1, 1, 0, 16, 5)
    assert torch.equal(a, ltd.keep(3, 0, 1, 1, 0, 16, 5)) and torch.equal(a, a.sort().values)
    assert not torch.equal(a, ltd.keep(3, 0, 2, 1, 0, 16, 5)) and a.numel() == 5


def test_refusals_are_located():
    with pytest.raises(TpirError) as e:
        parse_units("0:2", 4)
    assert "middle units (1..2)" in e.value.render()
    with pytest.raises(TpirError) as e:
        RandomLTD(units=(1,), min_value=9, max_value=4, require_steps=1)
    assert "above max_value" in e.value.render()
    with pytest.raises(TpirError) as e:
        RandomLTD(units=(1,), min_value=1, max_value=4, require_steps=1, schedule_type="fixed_root")
    assert "fixed_linear" in e.value.render()
    assert parse_units("1:3", 4) == (1, 2) and parse_units("2,1", 4) == (1, 2)
    with pytest.raises(TpirError) as e:
        from_flags("1:3", "5,13")
    assert "MIN,MAX,REQUIRE_STEPS" in e.value.render()
    deepspeed = ('{"random_ltd_schedule": {"min_value": 128, "max_value": 2048, "schedule_type": "fixed_linear", '
                 '"schedule_config": {"require_steps": 200000, "seq_per_step": 16}}}')
    assert from_flags("1:3", deepspeed) == RandomLTD((1, 2), 128, 2048, 200000, 16)
    whole = '{"data_efficiency": {"data_routing": {"random_ltd": ' + deepspeed + '}}}'
    assert from_flags("1:3", whole) == RandomLTD((1, 2), 128, 2048, 200000, 16)
    assert from_flags("1:3", "128,2048,200000,16") == RandomLTD((1, 2), 128, 2048, 200000, 16)


def test_dropping_the_first_unit_is_refused_when_building_the_stage():
    model, vocab = nanogpt()
    sliced = SlicedModel.from_model(model, seq_len=SEQ, vocab=vocab)
    with pytest.raises(TpirError) as e:
        sliced.stage_module(0, sliced.num_units, dropped=(0,))
    assert "is the first" in e.value.render()
