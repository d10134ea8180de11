"""Packed documents (`documents eos ID mean M`): a plan over rows of several documents must give,
within 1e-5, the loss and gradients of plain PyTorch running EACH DOCUMENT ON ITS OWN through the
unsliced model (no mask, positions from 0), the target after each separator left out and the sum
divided by the batch's tokens. For examples/nanogpt.py, examples/llama.py (torchtitan's Llama 3)
and a Hugging Face Llama, unsliced and sliced, under the interpreter and (SLOW) torchrun on gloo.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.executors.dist_harness import torchrun_many
from tests.executors.real import model_file, traced
from tpc.cli.compile import check_options
from tpc.compiler.frontend import file_sha256
from tpc.compiler.frontend.model_file import logits_of
from tpc.compiler.header import build_header
from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule
from tpc.executors.interpreter import interpret
from tpc.executors.oracle import gradient_error, gradient_floor
from tpc.executors.options import RunOptions

EOS = 2
SEQ = 16


class Rows:
    """A fixed batch of packed rows: documents of several lengths, one of a single token (its
    separator), documents starting exactly at a slice boundary (8) in both rows of a micro-batch
    (that slice reads no cached token), a row ending in a separator, a
    row of one document."""

    def __init__(self, vocab: int, batch: int = 4):
        g = torch.Generator().manual_seed(3)
        t = torch.randint(3, vocab, (batch, SEQ + 1), generator=g)
        for row, ends in enumerate([(2, 7, 8, 12), (4, 7, 15), (), (0, 9, 10)][:batch]):
            for e in ends:
                t[row, e] = EOS
        self.tokens = t

    def get(self, step: int) -> torch.Tensor:
        return self.tokens


def per_document(model, tokens: torch.Tensor):
    """Plain PyTorch: every document alone through the unsliced model; loss and gradients."""
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    total = 0.0
    for r in range(ids.size(0)):
        cuts = [0] + [i + 1 for i in range(SEQ) if int(ids[r, i]) == EOS and i + 1 < SEQ] + [SEQ]
        for a, b in zip(cuts, cuts[1:]):
            logits = logits_of(model(ids[r:r + 1, a:b]))[0]  # this document alone, positions 0..b-a-1
            want = targets[r, a:b].clone()
            want[ids[r, a:b] == EOS] = -100  # the separator's target is the next document's first token
            total = total + F.cross_entropy(logits.float(), want, reduction="sum")
    loss = total / ids.numel()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return float(loss.detach()), {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params, grads)}


def document_plan(path: str, *, stages: int, slices: str, microbatches: int = 2, schedule: str = "seq1f1b",
                  recompute: str = "none"):
    model, sliced, vocab = traced(path, SEQ)
    opts = check_options(stages=str(stages), microbatches=microbatches, seq_len=SEQ, batch=4, slices=slices,
                         schedule=schedule, documents=f"eos:{EOS}")
    ranges = [tuple(r) for r in sliced.partition_by_params(stages)]
    header = build_header(model_path=path, sha256=file_sha256(path), factory="model", opts=opts, vocab=vocab,
                          unit_labels=sliced.unit_labels, ranges=ranges, ties=sliced.ties(ranges))
    from tpc.compiler.lowering.recompute import apply as apply_recompute
    from tpc.compiler.lowering.recompute import uniform

    compute = apply_recompute(build_schedule(schedule, header), uniform(header, recompute))
    return lower(header, compute), model, sliced, vocab


def hf_llama_file(tmp_path_factory) -> str:
    pytest.importorskip("transformers")
    from tests.compiler.frontend.hf_models import config_dict

    path = tmp_path_factory.mktemp("hf") / "config.json"
    path.write_text(json.dumps(config_dict("llama", attn_implementation="sdpa", max_position_embeddings=32)))
    return str(path)


CASES = [
    # model, stages, slices, micro-batches, schedule
    ("nanogpt", 1, "1", 1, "gpipe"),  # unsliced
    ("nanogpt", 2, "3,5,8", 2, "seq1f1b"),  # a document starts at token 8, a slice boundary
    ("gpt", 2, "4,4,8", 2, "1f1b"),  # examples/gpt.py
    ("llama", 1, "1", 1, "gpipe"),
    ("llama", 2, "1,7,8", 2, "terapipe"),
    ("hf-llama", 1, "1", 1, "gpipe"),
    ("hf-llama", 2, "5,3,8", 2, "1f1b"),
    ("alibi", 2, "3,5,8", 2, "seq1f1b"),  # a position bias, read at the positions within the documents
]


@pytest.mark.parametrize("name,stages,slices,mbs,schedule", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_each_document_as_if_alone(tmp_path_factory, name, stages, slices, mbs, schedule):
    path = hf_llama_file(tmp_path_factory) if name == "hf-llama" else model_file(name)
    plan, model, sliced, vocab = document_plan(path, stages=stages, slices=slices, microbatches=mbs, schedule=schedule)
    rows = Rows(vocab)
    ref_loss, ref_grads = per_document(copy.deepcopy(model), rows.tokens)
    result = interpret(plan, RunOptions(steps=1, documents=EOS), model=copy.deepcopy(model), sliced=sliced,
                       batches=rows)
    assert abs(result.losses[0] - ref_loss) <= 1e-5 * abs(ref_loss)
    worst, where = gradient_error(result.first_grads, ref_grads, floor=gradient_floor(ref_grads))
    assert worst <= 1e-5, f"{where}: {worst:.3g}"


def test_recomputed_slices_read_their_documents_again():
    """With every forward checkpointed and recomputed, no finished document is dropped before
    the recompute reads it: still each document as if alone."""
    plan, model, sliced, vocab = document_plan(model_file("nanogpt"), stages=2, slices="3,5,8", recompute="full")
    assert any(i.checkpoint for r in plan.ranks for i in r.instrs)
    rows = Rows(vocab)
    ref_loss, ref_grads = per_document(copy.deepcopy(model), rows.tokens)
    result = interpret(plan, RunOptions(steps=1, documents=EOS), model=copy.deepcopy(model), sliced=sliced,
                       batches=rows)
    assert abs(result.losses[0] - ref_loss) <= 1e-5 * abs(ref_loss)
    assert gradient_error(result.first_grads, ref_grads, floor=gradient_floor(ref_grads))[0] <= 1e-5


def test_across_documents_differs_from_the_oracle():
    """The oracle can tell: the same rows trained as one text each give other gradients."""
    from tests.executors.real import real_plan

    plan = real_plan("nanogpt", stages=1, microbatches=1, slices="1", schedule="gpipe", seq_len=SEQ)
    model, sliced, vocab = traced(model_file("nanogpt"), SEQ)
    rows = Rows(vocab)
    _, ref_grads = per_document(copy.deepcopy(model), rows.tokens)
    result = interpret(plan, RunOptions(steps=1), model=copy.deepcopy(model), sliced=sliced, batches=rows)
    assert gradient_error(result.first_grads, ref_grads)[0] > 1e-2


def test_a_slice_that_starts_its_documents_reads_no_earlier_slice():
    """Its prefix is narrowed to nothing: the earlier slices' keys and values get no gradient
    from it, and an earlier document's cache is not read (the row of one document is)."""
    _, sliced, vocab = traced(model_file("nanogpt"), SEQ)
    stage = sliced.stage_module(0, sliced.num_units, documents=True)
    ids = torch.randint(3, vocab, (2, SEQ))
    starts = ((0, 3, 8), (0,))  # row 0: a document starts at 8; row 1: one document
    y, kv = stage(ids[:, :8], 0, stage.empty_kv(2), torch.zeros(2, 8, dtype=torch.long), documents=starts)
    prefix = [k.detach().requires_grad_(True) for k in kv]
    out, _ = stage(ids[:, 8:], 8, prefix, torch.zeros(2, 8, dtype=torch.long), documents=starts)
    out.backward()
    row0 = [p.grad[0] for p in prefix if p.grad is not None]
    row1 = [p.grad[1] for p in prefix if p.grad is not None]
    assert row0 and all(float(g.abs().max()) == 0.0 for g in row0)
    assert any(float(g.abs().max()) > 0.0 for g in row1)


def test_a_model_whose_state_cannot_be_reset_is_refused():
    from tpc.ir.diagnostics import TpirError

    _, sliced, _ = traced(model_file("rwkv"), SEQ)
    with pytest.raises(TpirError) as e:
        sliced.check_documents()
    d = e.value.diagnostics[0]
    assert "cannot be reset at a document boundary" in d.message and d.loc is not None
    assert d.loc.file.endswith("token_shift.py")  # the model tiny_rwkv.py builds


def _token_file(tmp_path, docs) -> str:
    toks = [t for d in docs for t in d]
    path = tmp_path / "train.bin"
    np.array(toks, dtype=np.uint16).tofile(path)
    return str(path)


def test_token_file_rows_start_at_documents_and_bad_input_is_refused(tmp_path):
    from tpc.executors.training.token_file import TokenFileBatches, document_profile
    from tpc.ir.diagnostics import TpirError

    docs = [[5] * n + [EOS] for n in (3, 9, 1, 6, 4, 11, 2) * 4]
    path = _token_file(tmp_path, docs)
    batches = TokenFileBatches(path, seed=0, batch=8, seq=SEQ, vocab=64, eos=EOS)
    starts = set(np.concatenate(([0], np.flatnonzero(np.fromfile(path, dtype=np.uint16) == EOS) + 1)).tolist())
    assert set(batches._offsets(0).tolist()) <= starts
    prof = document_profile(path, EOS)
    assert prof.count == len(docs) and prof.longest == 12 and abs(prof.mean - np.mean([len(d) for d in docs])) < 1e-9
    with pytest.raises(TpirError, match="outside the model's vocabulary"):
        TokenFileBatches(path, seed=0, batch=8, seq=SEQ, vocab=64, eos=64)
    long = _token_file(tmp_path, docs[:3] + [[5] * 20 + [EOS]] + docs)
    with pytest.raises(TpirError) as e:
        TokenFileBatches(long, seed=0, batch=8, seq=SEQ, vocab=64, eos=EOS)
    assert "document 3 (tokens" in str(e.value) and "21 tokens, longer than a row of 16" in str(e.value)


def test_plan_and_run_must_agree_on_documents(tmp_path, capsys, monkeypatch):
    from tpc.cli.main import main

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    plain = tmp_path / "plain.tpir"
    packed = tmp_path / "packed.tpir"
    model = model_file("nanogpt")
    common = ["--stages", "2", "--seq-len", str(SEQ), "--batch", "2", "--slices", "2", "--quiet"]
    assert main(["compile", model, "-o", str(plain), *common]) == 0
    data = _token_file(tmp_path, [[7] * n + [EOS] for n in (3, 9, 1, 6) * 10])
    assert main(["compile", model, "-o", str(packed), *common, "--documents", f"eos:{EOS}",
                 "--document-length", data]) == 0
    assert "documents eos 2 mean 6\n" in packed.read_text()  # (4 + 10 + 2 + 7) / 4 = 5.75 measured
    assert main(["compile", model, "-o", str(tmp_path / "x.tpir"), *common, "--documents", "eos:999"]) == 1
    assert "outside the model's vocabulary of 256" in capsys.readouterr().err
    assert main(["run", "--interpret", str(plain), "--documents", f"eos:{EOS}"]) == 1
    assert "compiled for rows of one text each" in capsys.readouterr().err
    assert main(["run", "--interpret", str(packed)]) == 1
    assert "run with --documents eos:2" in capsys.readouterr().err
    assert main(["run", "--interpret", str(packed), "--documents", f"eos:{EOS}", "--verify-grads"]) == 0
    assert ": ok" in capsys.readouterr().out


TORCHRUN = {"nanogpt": 3, "llama": 3, "hf-llama": 2}  # model: stages (= processes)


@pytest.mark.parametrize("stages", sorted(set(TORCHRUN.values())), ids=lambda n: f"{n}-ranks")
def test_torchrun_gloo_matches_each_document_alone(tmp_path, tmp_path_factory, stages):
    """Three stages on three processes (a Hugging Face Llama's two layers: two): the middle rank
    loads each micro-batch for its boundaries; --verify-grads compares with the per-document
    oracle (executors/oracle.py). The models of one process count share one torchrun launch
    (dist_harness.torchrun_many); each run is checked on its own, by name."""
    plans = {}
    for name in (n for n, s in TORCHRUN.items() if s == stages):
        path = hf_llama_file(tmp_path_factory) if name == "hf-llama" else model_file(name)
        plans[name], *_ = document_plan(path, stages=stages, slices="3,5,8", microbatches=2)
    data = _token_file(tmp_path, [[7] * n + [EOS] for n in (3, 9, 1, 6, 4, 11, 2, 7) * 20])
    shown = torchrun_many(plans, tmp_path, ["--steps", "2", "--verify-grads", "--timeout", "60", "--device", "cpu",
                                            "--data", data, "--documents", f"eos:{EOS}"])
    assert set(shown) == set(plans)
    for name, text in shown.items():
        assert "verify-grads: loss" in text and ": ok" in text, (name, text[-2000:])


def test_finished_documents_leave_the_cache():
    """The runtime drops the keys and values of documents no later slice reads (both rows start
    a document at 8: after the slice [4, 8) the cache holds nothing), and the gradients are still
    those of each document alone."""
    from tpc.executors.stage_runtime import StageRuntime
    from tpc.executors.training.documents import document_starts, mask_crossing_targets

    model, sliced, vocab = traced(model_file("nanogpt"), SEQ)
    rows = Rows(vocab, batch=2)
    ids, targets = rows.tokens[:, :-1], rows.tokens[:, 1:]
    starts = document_starts(ids, EOS)
    targets = mask_crossing_targets(ids, targets, EOS)
    copy_ = copy.deepcopy(model)
    stage = sliced.stage_module(0, sliced.num_units, params_from=copy_, documents=True)
    runtime = StageRuntime(stage, 1.0 / ids.numel())
    held = []
    for sl, lo in enumerate(range(0, SEQ, 4)):
        runtime.forward(0, sl, ids[:, lo:lo + 4], lo, targets=targets[:, lo:lo + 4], capacity=SEQ, documents=starts)
        held.append(max(b.size(d) for b, d in zip(runtime.kv_buffers(0), stage.kv_dims)))
    assert held[1] == 0 and held[2] == 4 and max(held) < SEQ
    for sl in reversed(range(SEQ // 4)):
        runtime.backward(0, sl)
    got = {n: p.grad for n, p in copy_.named_parameters() if p.grad is not None}
    _, ref = per_document(copy.deepcopy(model), rows.tokens)
    worst, where = gradient_error(got, ref, floor=gradient_floor(ref))
    assert worst <= 1e-5, f"{where}: {worst:.3g}"
