"""The public API (`import tpc`, docs/library.md): compiling a model object or a file, loading
a plan, a pipeline's parameters and state by the unsliced model's names, and the errors a user
meets said in the user's terms."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import tpc
from tests.executors.dist_harness import launch
from tpc.ir.diagnostics import TpirError
from tpc.ir.printer import print_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT = os.path.join(ROOT, "examples", "gpt.py")


def _gpt(seed: int = 0):
    from tpc.compiler.frontend import load_model

    torch.manual_seed(seed)
    return load_model(GPT)


def _batch(plan, seed: int = 3):
    shape = plan.header.shape
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_the_public_api_is_what_the_docs_list():
    assert sorted(tpc.__all__) == sorted(["compile", "load", "pipeline", "with_forward", "Pipeline", "Plan",
                                          "LoadedBundle"])
    assert all(callable(getattr(tpc, name)) for name in tpc.__all__)


def test_a_file_and_an_object_compile_to_the_same_program(tmp_path):
    from_file = tpc.compile(GPT, seq_len=16, batch=4, stages=2, microbatches=2, slices=2,
                            output=str(tmp_path / "p.tpir"))
    assert tpc.load(tmp_path / "p.tpir").header == from_file.header
    from_object = tpc.compile(_gpt(), seq_len=16, batch=4, stages=2, microbatches=2, slices=2)
    assert from_object.header.model.factory == "<object>"
    assert [p.instrs for p in from_object.ranks] == [p.instrs for p in from_file.ranks]
    assert from_object.header.stages == from_file.header.stages


def test_compiling_leaves_the_users_random_stream_as_it_was():
    torch.manual_seed(5)
    tpc.compile(_gpt(), seq_len=16, batch=4, stages=2, slices=2)
    after = torch.rand(3)
    torch.manual_seed(5)
    _gpt()
    assert torch.equal(after, torch.rand(3))


def test_state_dict_names_are_the_models_and_load_back():
    model = _gpt()
    plan = tpc.compile(model, seq_len=16, batch=4, stages=2, microbatches=2, slices=2)
    pipe = tpc.pipeline(plan, model, interpret=True)
    names = {n for n, _ in model.named_parameters()}
    assert set(pipe.state_dict()) == names
    other = _gpt(seed=9)
    pipe.load_state_dict(other.state_dict())  # a whole model's state_dict
    for n, p in other.named_parameters():
        assert torch.equal(pipe.state_dict()[n], p.detach()), n
    x, y = _batch(plan)
    loss = pipe.step(x, y)
    want = torch.nn.functional.cross_entropy(other(x).reshape(-1, plan.header.shape.vocab), y.reshape(-1))
    assert abs(float(loss) - float(want)) <= 1e-5 * float(want)
    assert abs(float(pipe.eval_step(x, y)) - float(want)) <= 1e-5 * float(want)
    with pytest.raises(TpirError, match="not in the state_dict"):
        pipe.load_state_dict({"lm_head.weight": other.lm_head.weight})
    pipe.load_state_dict({n: v for n, v in list(other.state_dict().items())[:1]}, strict=False)


def test_the_step_leaves_the_gradients_and_updates_nothing():
    """Without the user's optimizer step a pipeline's step changes no weight; gradients add up
    over steps until zeroed, as after two backward passes."""
    model = _gpt()
    plan = tpc.compile(model, seq_len=16, batch=4, stages=2, slices=2)
    pipe = tpc.pipeline(plan, model, interpret=True)
    before = {n: v.clone() for n, v in pipe.state_dict().items()}
    x, y = _batch(plan)
    pipe.step(x, y)
    once = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    assert all(torch.equal(before[n], v) for n, v in pipe.state_dict().items())
    pipe.step(x, y)
    for n, p in pipe.named_parameters():
        assert torch.allclose(p.grad, 2 * once[n], rtol=1e-5, atol=1e-7), n
    pipe.zero_grad()
    assert all(p.grad is None for p in pipe.parameters())


def test_bad_batches_are_refused_in_the_users_terms():
    model = _gpt()
    plan = tpc.compile(model, seq_len=16, batch=4, stages=2, microbatches=2, slices=2)
    pipe = tpc.pipeline(plan, model, interpret=True)
    x, y = _batch(plan)
    with pytest.raises(TpirError, match=r"inputs of shape \(2, 16\).*4 rows of 16 tokens.*micro-batches of 2, 2 rows"):
        pipe.step(x[:2], y[:2])
    with pytest.raises(TpirError, match=r"a batch of shape \(4, 8\), but the plan trains batches of 4 rows of 16"):
        pipe.step(x[:, :8], y[:, :8])
    with pytest.raises(TpirError, match=r"targets of shape \(4, 15\)"):
        pipe.step(x, y[:, 1:])
    with pytest.raises(TpirError, match=r"inputs of dtype torch.float32"):
        pipe.step(x.float(), y)
    bad = y.clone()
    bad[0, 0] = plan.header.shape.vocab
    with pytest.raises(TpirError, match=r"targets hold token \d+, outside the vocabulary \[0, \d+\)"):
        pipe.step(x, bad)
    pipe.eval()
    with pytest.raises(TpirError, match=r"step\(\) on a pipeline in eval mode"):
        pipe.step(x, y)
    pipe.train()
    assert pipe.step(x.int(), y.int()).dtype == torch.float64  # int32 ids are taken as int64


def test_an_optimizer_over_the_models_own_parameters_is_refused_with_the_fix():
    """In one process the pipeline's ranks train copies of the model: an optimizer over the
    model's parameters would update nothing the pipeline computes with."""
    model = _gpt()
    plan = tpc.compile(model, seq_len=16, batch=4, stages=2, slices=2)
    pipe = tpc.pipeline(plan, model, interpret=True)
    pipe.step(*_batch(plan))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TpirError, match=r"AdamW.step\(\): the optimizer holds '.*', a parameter this rank does "
                                         r"not train.*\n.*AdamW\(pipe.parameters\(\)"):
        opt.step()
    good = torch.optim.AdamW(pipe.parameters())
    good.step()  # the pipeline's own parameters: fine
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    other.step()  # an optimizer of something else in the same script: not tpc's business


def _optimizer_on_rank_1(rank: int, out_dir: str) -> None:
    model = _gpt()
    plan = tpc.compile(model, seq_len=16, batch=4, stages=2, slices=2)
    pipe = tpc.pipeline(plan, model, device="cpu")
    pipe.step(*_batch(plan))
    try:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    except TpirError as e:
        with open(os.path.join(out_dir, f"said{rank}.txt"), "w") as f:
            f.write(str(e))
    pipe.close()


def test_under_torchrun_the_refusal_names_the_rank_that_trains_the_parameter(tmp_path):
    codes, errs = launch(2, tmp_path, _optimizer_on_rank_1, limit=240)
    assert codes == [0, 0], errs
    said0 = (tmp_path / "said0.txt").read_text()
    said1 = (tmp_path / "said1.txt").read_text()
    assert "pipeline rank 1's stages train it" in said0, said0
    assert "pipeline rank 0's stages train it" in said1, said1


def test_a_multi_rank_plan_outside_torchrun_says_how_to_start_it(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    model = _gpt()
    plan = tpc.compile(model, seq_len=16, batch=4, stages=2, slices=2)
    with pytest.raises(TpirError, match=r"runs on 2 ranks .* not started by torchrun(.|\n)*torchrun "
                                        r"--nproc-per-node 2 SCRIPT.*interpret=True"):
        tpc.pipeline(plan, model)


def test_a_one_rank_plan_runs_in_the_process_without_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    model = _gpt()
    plan = tpc.compile(model, seq_len=16, batch=4, stages=1, microbatches=2, slices=2)
    pipe = tpc.pipeline(plan, model)
    x, y = _batch(plan)
    want = torch.nn.functional.cross_entropy(model(x).reshape(-1, plan.header.shape.vocab), y.reshape(-1))
    assert abs(float(pipe.step(x, y)) - float(want)) <= 1e-5 * float(want)


def test_a_plan_of_a_model_object_needs_the_object(tmp_path):
    plan = tpc.compile(_gpt(), seq_len=16, batch=4, stages=2, slices=2)
    with pytest.raises(TpirError, match=r"compiled from a model object; pass the object"):
        tpc.pipeline(plan, interpret=True)
    path = tmp_path / "p.tpir"
    path.write_text(print_plan(plan), encoding="utf-8")
    tpc_cmd = os.path.join(os.path.dirname(sys.executable), "tpc")
    done = subprocess.run([tpc_cmd if os.path.exists(tpc_cmd) else "tpc", "run", "--interpret", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "compiled from a model object" in done.stderr and "tpc.pipeline(plan, model)" in done.stderr, done.stderr


def test_compile_options_are_tpc_compiles_and_mistakes_are_located():
    with pytest.raises(TpirError, match=r"unknown option\(s\) stagez"):
        tpc.compile(_gpt(), seq_len=16, batch=4, stagez=2)
    with pytest.raises(TpirError, match=r"--slices"):
        tpc.compile(_gpt(), seq_len=16, batch=4, slices=(5, 5))
    with pytest.raises(TpirError, match=r"the model is a str|no such model file"):
        tpc.compile("no/such/model.py", seq_len=16, batch=4)


def test_a_bundle_steps_each_batch_with_the_plan_of_its_length(tmp_path):
    """seq_len=(8, 16) compiles a plan per length on one stage split; the pipeline steps an
    8-token batch and a 16-token batch, each by its plan, on the same weights: plain PyTorch's
    losses and weights, after SGD steps of the user's."""
    import copy

    model = _gpt()
    ref = copy.deepcopy(model)
    bundle = tpc.compile(model, seq_len=(8, 16), batch=4, stages=2, slices=2, output=str(tmp_path / "plans"))
    assert bundle.lengths == (8, 16) and isinstance(tpc.load(tmp_path / "plans"), tpc.LoadedBundle)
    pipe = tpc.pipeline(bundle, model, interpret=True)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(2)
    for length in (8, 16, 8):
        tokens = torch.randint(0, bundle.plans[0].header.shape.vocab, (4, length + 1), generator=g)
        loss = pipe.step(tokens)  # (rows, seq + 1): each position predicts the next
        opt.step()
        opt.zero_grad()
        out = ref(tokens[:, :-1])
        want = torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), tokens[:, 1:].reshape(-1))
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(float(loss) - float(want)) <= 1e-5 * float(want), (length, float(loss), float(want))
    for n, p in ref.named_parameters():
        assert torch.allclose(pipe.state_dict()[n], p.detach(), rtol=0, atol=1e-5), n
    with pytest.raises(TpirError, match=r"a batch of shape \(4, 12\), but the plan trains batches of 4 rows of 8, 16"):
        pipe.step(torch.zeros(4, 13, dtype=torch.long))
    with pytest.raises(TpirError, match=r"a plan bundle is written into a folder"):
        tpc.compile(model, seq_len=(8, 16), batch=4)


def test_a_torch_schedule_csv_compiles_from_python(tmp_path):
    """`schedule_file=` is `tpc compile --schedule-file`: torch's own GPipe, written by
    torch.distributed.pipelining, as the plan of a model object."""
    from tests.compiler.torch_schedules import build, dump
    import torch.distributed.pipelining.schedules as S

    csv = dump(build(S.ScheduleGPipe, 2, 1, 4), tmp_path / "gpipe.csv")
    plan = tpc.compile(_gpt(), seq_len=16, batch=4, schedule_file=csv, output=str(tmp_path / "p.tpir"))
    assert plan.header.num_stages == 2 and len(plan.header.microbatches) == 4
    assert tpc.load(tmp_path / "p.tpir").header.model.factory == "<object>"
    with pytest.raises(TpirError, match=r"recompute with a schedule file"):
        tpc.compile(_gpt(), seq_len=16, batch=4, schedule_file=csv, recompute="full")


def _from_file_rank(rank: int, out_dir: str, path: str) -> None:
    pipe = tpc.pipeline(path, device="cpu")  # no model: this rank builds its own parameters (seed 0)
    plan = tpc.load(path)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses = []
    for seed in (3, 4):
        losses.append(float(pipe.step(*_batch(plan, seed))))
        opt.step()
        opt.zero_grad()
    torch.save({"losses": losses, "state": pipe.state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    pipe.close()


def test_a_plan_file_runs_under_torchrun_with_each_rank_building_only_its_parameters(tmp_path):
    """`tpc.pipeline(PATH)` without a model: each rank builds its own stages' parameters from the
    plan's model file and seed, as `tpc run` does; the losses and weights are plain PyTorch's on
    the model the seed builds."""
    from tpc.executors.plan_model import load_plan_model

    path = str(tmp_path / "p.tpir")
    plan = tpc.compile(GPT, seq_len=16, batch=4, stages=2, microbatches=2, slices=2, output=path)
    codes, errs = launch(2, tmp_path, _from_file_rank, path, limit=240)
    assert codes == [0, 0], errs
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert set(parts[0]["state"]).isdisjoint(set(parts[1]["state"]) - {"transformer.wte.weight"})
    ref = load_plan_model(plan, seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for seed, got in zip((3, 4), parts[0]["losses"]):
        x, y = _batch(plan, seed)
        loss = torch.nn.functional.cross_entropy(ref(x).reshape(-1, plan.header.shape.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(got - float(loss)) <= 1e-5 * float(loss)
    state = {**parts[0]["state"], **parts[1]["state"]}
    for n, p in ref.named_parameters():
        assert torch.allclose(state[n], p.detach(), rtol=0, atol=1e-5), n


def test_a_plan_over_packed_documents_steps_from_the_library():
    """`documents="eos:0"` is `tpc compile --documents eos:0`: the pipeline's step reads each
    row's documents from the batch and equals plain PyTorch running each document alone."""
    from tpc.executors.oracle import batch_reference

    model = _gpt()
    plan = tpc.compile(model, seq_len=16, batch=2, stages=2, slices=2, documents="eos:0")
    pipe = tpc.pipeline(plan, model, interpret=True)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, plan.header.shape.vocab, (2, 17), generator=g)
    tokens[0, 6] = tokens[1, 9] = 0  # a second document in each row
    assert abs(float(pipe.step(tokens)) - batch_reference(model, tokens, 0).loss) <= 1e-5
