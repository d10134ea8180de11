"""Tensor parallelism run by the executors (issue #34): plans whose mesh has a tensor axis, run by
the reference interpreter (each tensor coordinate on a thread) and under torchrun on gloo, against
plain single-process autograd on the unsliced model, on code nobody here wrote (Hugging Face
Llama with grouped-query attention and GPT-2 from configs) and on the nanoGPT- and
torchtitan-style examples; 50 training steps against the same plan without the axis; the bytes a
rank holds; what is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.executors.dist_harness import torchrun_verified_many
from tests.executors.real import model_file, real_plan, traced
from tpc.executors.interpreter import interpret
from tpc.executors.oracle import batch_reference, gradient_error
from tpc.executors.options import RunOptions
from tpc.executors.training.batches import RandomTokens
from tpc.executors.training.export import export_state_dict
from tpc.executors.training.run_checkpoints import RunCheckpoints
from tpc.executors.training.optimizer import OptimSpec
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Op

TOL = 1e-5
SEQ = 16
# tiny_nanogpt: nanoGPT's model.py (fused QKV, tied head); tiny_llama: the torchtitan-style
# examples/llama.py (complex RoPE, SwiGLU, 2 query heads and 1 key/value head: the key/value
# projection replicated over 2 ranks); hf-llama: 4 query heads, 2 key/value heads (split);
# hf-gpt2: Conv1D, fused QKV, tied head
MODELS = ["nanogpt", "llama", "hf-llama", "hf-gpt2"]


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    from tests.compiler.frontend.hf_models import config_dict

    out = {}
    for family in ("llama", "gpt2"):
        path = tmp_path_factory.mktemp(family) / "config.json"
        path.write_text(json.dumps(config_dict(family)))
        out[f"hf-{family}"] = str(path)
    return out


def path_of(name: str, configs) -> str:
    return configs[name] if name.startswith("hf-") else model_file(name)


def plan_for(name, configs, **kw):
    return real_plan(name, path=path_of(name, configs), seq_len=SEQ, **kw)


def fresh(name, configs):
    model, sliced, _ = traced(path_of(name, configs), SEQ)
    return copy.deepcopy(model), sliced


def reference(name, configs, plan):
    h = plan.header
    model, _ = fresh(name, configs)
    return batch_reference(model, RandomTokens(0, h.shape.batch, SEQ, h.shape.vocab).get(0))


CASES = {  # name: (stages, micro-batches, slices, schedule, data replicas, sequence parallelism)
    "pp2xtp2-unsliced": (2, 2, "1", "1f1b", 1, False),
    "pp2xtp2-sliced": (2, 2, "2,9,5", "seq1f1b", 1, False),
    "pp2xtp2xdp2-sliced": (2, 2, "3", "gpipe", 2, False),
    # sequence parallelism: every slice's tokens split over the 2 tensor ranks between regions
    "pp2xtp2-sp-unsliced": (2, 2, "1", "1f1b", 1, True),
    "pp2xtp2-sp-sliced": (2, 2, "4,8,4", "seq1f1b", 1, True),
    "pp2xtp2xdp2-sp-sliced": (2, 2, "4", "gpipe", 2, True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", MODELS)
def test_interpreter_matches_autograd(name, case, configs):
    stages, mbs, slices, schedule, dp, sequence = CASES[case]
    plan = plan_for(name, configs, stages=stages, microbatches=mbs, slices=slices, schedule=schedule, dp=dp,
                    tensor=2, sequence=sequence)
    assert plan.header.mesh.sequence == sequence
    model, sliced = fresh(name, configs)
    result = interpret(plan, RunOptions(steps=1), model=model, sliced=sliced)
    ref_loss, ref_grads, _ = reference(name, configs, plan)
    # every parameter's gradient, the rank's parts joined to the full shape
    assert set(result.first_grads) == set(ref_grads)
    worst, where = gradient_error(result.first_grads, ref_grads)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - ref_loss) <= TOL * abs(ref_loss)


def _has_pairs(plan) -> bool:
    """Some rank's stream holds the forwards of slices i and i + 1 of a stage side by side."""
    return any(a.op is Op.FORWARD and b.op is Op.FORWARD and b.key == (a.stage, a.mb, a.slice + 1)
               for prog in plan.ranks for a, b in zip(prog.instrs, prog.instrs[1:]))


def _counting(mp, counts: dict) -> None:
    """Count the pairs the stage runtimes run, forwards and backwards."""
    from tpc.executors.stage_runtime import StageRuntime

    for what in ("forward_pair", "backward_pair"):
        original = getattr(StageRuntime, what)

        def counted(self, *a, _what=what, _original=original, **k):
            counts[_what] = counts.get(_what, 0) + 1
            return _original(self, *a, **k)
        mp.setattr(StageRuntime, what, counted)


@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("name", MODELS)
def test_slice_pairs_overlapping_their_collectives_compute_what_the_plain_plan_computes(name, sequence, configs):
    """`--tensor-overlap`: the interpreter runs each pair of forwards and each pair of backwards
    as one program (counted; the paired stages through their traced programs); two clipped
    steps' losses, gradients and weights equal the plain plan's (eager), bit for bit."""
    plain, paired, counts = _plain_and_paired("terapipe", name, sequence, configs)
    assert _has_pairs(paired) and not _has_pairs(plain)
    # 2 stages x 2 micro-batches x 2 pairs, on each of 2 tensor ranks, in each of 2 steps; the
    # plain plan runs none
    assert counts == {"forward_pair": 32, "backward_pair": 32}


def _plain_and_paired(schedule, name, sequence, configs):
    """A plan and the same with `--tensor-overlap`, each run two clipped steps in the
    interpreter: the two plans and the pairs both runs ran (`_counting`); the runs' losses,
    first gradients and weights after the steps are the same, bit for bit."""
    kw = dict(stages=2, microbatches=2, slices="4,4,4,4", schedule=schedule, tensor=2, sequence=sequence)
    plain, paired = plan_for(name, configs, **kw), plan_for(name, configs, overlap=True, **kw)
    runs, counts = [], {}
    for plan in (plain, paired):
        model, sliced = fresh(name, configs)
        with pytest.MonkeyPatch.context() as mp:
            _counting(mp, counts)
            runs.append(interpret(plan, RunOptions(steps=2, grad_clip=0.5), model=model, sliced=sliced))
    assert runs[0].losses == runs[1].losses
    for n, g in runs[0].first_grads.items():
        assert torch.equal(g, runs[1].first_grads[n]), n
    for n, w in runs[0].state_dict.items():
        assert torch.equal(w, runs[1].state_dict[n]), n
    return plain, paired, counts


@pytest.mark.parametrize("schedule,stages,slices", [("interleaved", 4, "3"), ("chimera", 2, "2")])
def test_several_stages_per_rank_and_weight_replicas_under_nccls_rules(schedule, stages, slices):
    """Two stages on each rank (each tensor rank's stages sharing its parts through one cache)
    and chimera's two weight replicas (reduce-replicas at the rank's tensor coordinate), with
    NCCL's rendezvous rules in the interpreter."""
    kw = dict(ranks=2) if schedule == "interleaved" else {}
    plan = real_plan("llama", seq_len=SEQ, stages=stages, slices=slices, microbatches=2, schedule=schedule,
                     tensor=2, **kw)
    model, sliced, _ = traced(model_file("llama"), SEQ)
    result = interpret(plan, RunOptions(steps=1, comm="nccl"), model=copy.deepcopy(model), sliced=sliced)
    h = plan.header
    ref_loss, ref_grads, _ = batch_reference(copy.deepcopy(model), RandomTokens(0, h.shape.batch, SEQ, h.shape.vocab).get(0))
    worst, where = gradient_error(result.first_grads, ref_grads)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - ref_loss) <= TOL * abs(ref_loss)


@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "tp-sp"])
def test_fifty_steps_equal_the_plan_without_the_axis(sequence):
    """AdamW with weight decay, clipping that acts (the norm is summed over the tensor group,
    a replicated weight counted once): losses, gradient norms and the weights after 50 steps,
    with and without sequence parallelism."""
    kw = dict(stages=2, microbatches=2, slices="4,8,4", schedule="seq1f1b", seq_len=SEQ, dp=2)
    opts = RunOptions(steps=50, grad_clip=0.5, optim=OptimSpec("adamw", weight_decay=0.1))
    runs = {}
    for tensor in (1, 2):
        norms = []
        model, sliced, _ = traced(model_file("nanogpt"), SEQ)
        plan = real_plan("nanogpt", tensor=tensor, sequence=sequence and tensor > 1, **kw)
        runs[tensor] = interpret(plan, opts, model=copy.deepcopy(model), sliced=sliced,
                                 on_step=lambda step, loss, info, n=norms: n.append(info["grad_norm"]))
        runs[tensor].norms = norms
    plain, split = runs[1], runs[2]
    assert max(n for n in plain.norms) > 0.5  # the clipping acted
    assert all(abs(a - b) <= TOL * abs(a) for a, b in zip(plain.losses, split.losses)), (plain.losses, split.losses)
    assert all(abs(a - b) <= TOL * a for a, b in zip(plain.norms, split.norms))
    start = traced(model_file("nanogpt"), SEQ)[0].state_dict()
    moved = max(float((plain.state_dict[k] - v).abs().max()) for k, v in start.items())
    assert moved > 5e-3  # 50 steps of AdamW at 3e-4 moved the weights
    # every weight (all of order 1) within 1e-5 of the run without the axis; AdamW's update,
    # near lr * sign(gradient), carries the sums' last-bit differences into the weights
    worst = max((float((split.state_dict[k] - w).abs().max()), k) for k, w in plain.state_dict.items())
    assert worst[0] <= TOL, worst


def test_a_rank_holds_its_part_of_the_weights_and_optimizer_state(configs):
    """Parameter and AdamW bytes per rank against the plan without the axis (Hugging Face
    Llama, its key/value heads split): the split weights at 1/T, the norms' weights whole."""
    held = {}
    for tensor in (1, 2):
        model, sliced = fresh("hf-llama", configs)
        plan = plan_for("hf-llama", configs, stages=2, microbatches=1, slices="1", schedule="1f1b", tensor=tensor)
        held[tensor] = interpret(plan, RunOptions(steps=1), model=model, sliced=sliced).held_bytes
    mesh = plan.header.mesh.value
    for r in mesh.ranks():
        p = mesh.pipe_rank(r)
        whole_params, whole_optim = held[1][p]
        params, optim = held[2][r]
        # AdamW's two moments of the rank's part (and a step count per tensor)
        assert 2 * params <= optim <= 2 * params + 8 * 16
        # a little above half: only the norms' weights are held whole
        assert 0.5 * whole_params < params <= 0.51 * whole_params, (params / whole_params)
        assert 0.5 * whole_optim < optim <= 0.51 * whole_optim, (optim / whole_optim)


def test_what_a_tensor_axis_does_not_run_is_refused_before_any_step():
    plan = real_plan("nanogpt", stages=2, microbatches=2, slices="1", schedule="1f1b", seq_len=SEQ, dp=2, tensor=2)
    steps = []
    with pytest.raises(TpirError) as e:
        interpret(plan, RunOptions(steps=1, shard_optimizer=True), on_step=lambda *a: steps.append(a))
    assert "--shard-optimizer with a tensor axis" in str(e.value) and "mesh pipe 2 data" in str(e.value)
    assert not steps


SPLIT = {  # case: (model, schedule, slices, sequence parallelism)
    "nanogpt-zb-h1": ("nanogpt", "zb-h1", "5,1,10", False),
    "hf-llama-zbv": ("hf-llama", "zbv", "2", False),
    "hf-gpt2-zb-h1-sp": ("hf-gpt2", "zb-h1", "4,8,4", True),
    "llama-seq-zb-sp": ("llama", "seq-zb", "4,8,4", True),
}


@pytest.mark.parametrize("case", list(SPLIT))
def test_split_backward_schedules_trace_the_ranks_programs_through_the_collectives(case, configs):
    """Zero-bubble schedules (backward-input, backward-weight) with a tensor axis: each rank's
    stage runs the programs traced from its part of the graph, whose collectives are operators
    of their own (`torch.ops.tpc.tensor_*`); loss and every gradient match autograd."""
    name, schedule, slices, sequence = SPLIT[case]
    stages = 4 if schedule == "zbv" else 2
    plan = plan_for(name, configs, stages=stages, microbatches=2, slices=slices, schedule=schedule, tensor=2,
                    sequence=sequence, **({"ranks": 2} if schedule == "zbv" else {}))
    assert any(i.op is Op.BACKWARD_INPUT for prog in plan.ranks for i in prog.instrs)
    from tpc.compiler.programs import stage_programs

    model, sliced = fresh(name, configs)
    derived = []
    original = stage_programs.derive

    def recorded(*a, **k):
        derived.append(original(*a, **k))
        return derived[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stage_programs, "derive", recorded)
        result = interpret(plan, RunOptions(steps=1), model=model, sliced=sliced)
    ref_loss, ref_grads, _ = reference(name, configs, plan)
    worst, where = gradient_error(result.first_grads, ref_grads)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - ref_loss) <= TOL * abs(ref_loss)
    # the collectives are nodes of the traced programs: every forward's g, and f's all-reduce of
    # an input gradient in the backward's input half
    def collectives_in(gm):
        return [n for n in gm.graph.nodes if str(n.target).startswith("tpc.tensor_")]

    assert derived and all(collectives_in(p.forward) for p in derived)
    assert any(collectives_in(p.backward_input) for p in derived)


def test_no_slice_pairs_runs_every_slice_alone_and_computes_the_same(configs):
    """`tpc run --no-slice-pairs` (RunOptions.slice_pairs=False) on a plan compiled with
    `--tensor-overlap`: no pair runs, no stage runs its programs for them, and the values are
    the paired run's, bit for bit."""
    from tpc.compiler.programs.stage_programs import StagePrograms

    plan = plan_for("nanogpt", configs, stages=2, microbatches=2, slices="4,4,4,4", schedule="terapipe",
                    tensor=2, overlap=True)
    runs, counts, used = [], {}, []
    original = StagePrograms.get
    for pairs in (True, False):
        counts.clear()
        used.clear()
        model, sliced = fresh("nanogpt", configs)
        with pytest.MonkeyPatch.context() as mp:
            _counting(mp, counts)
            # (programs are kept per process once derived: count their use, not their tracing)
            mp.setattr(StagePrograms, "get", lambda self, *a, **k: used.append(1) or original(self, *a, **k))
            runs.append(interpret(plan, RunOptions(steps=2, slice_pairs=pairs), model=model, sliced=sliced))
        assert bool(counts) == pairs and bool(used) == pairs
    assert runs[0].losses == runs[1].losses
    for n, w in runs[0].state_dict.items():
        assert torch.equal(w, runs[1].state_dict[n]), n


def _stream_pairs(plan, ops) -> int:
    """The pairs of computes of `ops` the executors run as one program each: side by side in a
    rank's stream (`lower.paired`), taken in stream order, none in two pairs."""
    from tpc.compiler.lowering.lower import paired

    count = 0
    for prog in plan.ranks:
        p = 0
        while p + 1 < len(prog.instrs):
            a, b = prog.instrs[p], prog.instrs[p + 1]
            both = paired(a, b) is not None
            count += both and a.op in ops
            p += 2 if both else 1
    return count


@pytest.mark.parametrize("name,sequence", [("nanogpt", False), ("hf-gpt2", True)])
def test_split_backward_slice_pairs_compute_what_the_plain_plan_computes(name, sequence, configs):
    """`--tensor-overlap` with zb-h1: the backward-inputs of slices i + 1 and i run as one
    program (and the forwards, through the traced programs); two clipped steps equal the plain
    plan's, bit for bit."""
    plain, paired, counts = _plain_and_paired("zb-h1", name, sequence, configs)
    want = {"forward_pair": _stream_pairs(paired, {Op.FORWARD}),
            "backward_pair": _stream_pairs(paired, {Op.BACKWARD_INPUT})}
    assert want["backward_pair"] > 0 and _stream_pairs(plain, {Op.BACKWARD_INPUT}) < want["backward_pair"]
    plain_counts = {"forward_pair": _stream_pairs(plain, {Op.FORWARD}),
                    "backward_pair": _stream_pairs(plain, {Op.BACKWARD_INPUT})}
    # every pair of either plan, on each of 2 tensor ranks, in each of 2 steps
    assert counts == {k: 4 * (want[k] + plain_counts[k]) for k in want}


def test_compiled_programs_with_a_tensor_axis_match_autograd():
    """`--compile` with a tensor axis: the ranks' programs compiled by inductor (each tensor rank
    on its thread prepares its programs before step 1, their collectives meeting), zb-h1."""
    configs = {}
    plan = plan_for("nanogpt", configs, stages=2, microbatches=2, slices="2", schedule="zb-h1", tensor=2)
    model, sliced = fresh("nanogpt", configs)
    result = interpret(plan, RunOptions(steps=1, compile=True), model=model, sliced=sliced)
    ref_loss, ref_grads, _ = reference("nanogpt", configs, plan)
    worst, where = gradient_error(result.first_grads, ref_grads)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - ref_loss) <= TOL * abs(ref_loss)


# ------------------------------------------------------------------------------- torchrun


TORCHRUN = {  # case: (model, stages, slices, schedule, data replicas, sequence parallelism, --tensor-overlap)
    "nanogpt": ("nanogpt", 2, "2,9,5", "seq1f1b", 1, False, False),
    "hf-llama-zb-h1": ("hf-llama", 2, "1", "zb-h1", 1, False, False),  # a split backward: traced programs
    "hf-gpt2": ("hf-gpt2", 2, "3", "seq1f1b", 1, False, False),
    "llama-overlap": ("llama", 2, "2,9,5", "terapipe", 2, False, True),  # 8 processes
    "nanogpt-sp": ("nanogpt", 2, "4,8,4", "seq1f1b", 1, True, False),
    "hf-gpt2-sp": ("hf-gpt2", 2, "4", "gpipe", 2, True, False),  # 8 processes; Conv1D flattens the tokens
    "hf-llama-sp": ("hf-llama", 2, "1", "1f1b", 1, True, False),
    "llama-sp-overlap": ("llama", 2, "4,4,4,4", "terapipe", 1, True, True),
}


def _world(case: str) -> int:  # 2 tensor ranks x the pipe (one stage a rank) x the data replicas
    _, stages, _, _, dp, _, _ = TORCHRUN[case]
    return 2 * stages * dp


WORLDS = sorted({_world(case) for case in TORCHRUN})


@pytest.mark.parametrize("world", WORLDS, ids=[f"{w}-ranks" for w in WORLDS])
def test_torchrun_gloo_matches_autograd_and_the_interpreter(world, configs, tmp_path):
    """`tpc run` under torchrun, one process per (tensor, pipe, data) rank: --verify-grads on
    the first step, the losses of 3 steps with clipping equal to the interpreter's, and the
    checkpoint each process wrote its parts into, exported whole, the interpreter's weights.
    The cases of one world size share one torchrun launch (each rank runs `tpc run` of each
    plan in turn: dist_harness.torchrun_verified_many); each is checked on its own, by name."""
    plans = {}
    for case in (c for c in TORCHRUN if _world(c) == world):
        name, stages, slices, schedule, dp, sequence, overlap = TORCHRUN[case]
        plan = plan_for(name, configs, stages=stages, microbatches=2, slices=slices, schedule=schedule, dp=dp,
                        tensor=2, sequence=sequence, overlap=overlap)
        assert overlap == _has_pairs(plan), case
        assert plan.header.mesh.value.size == world, case
        plans[case] = plan
    runs = torchrun_verified_many(plans, tmp_path)
    for case, plan in plans.items():
        rows = runs[case]
        model, sliced = fresh(TORCHRUN[case][0], configs)
        res = interpret(plan, RunOptions(steps=3, grad_clip=0.5), model=model, sliced=sliced)
        assert [r["step"] for r in rows] == [1, 2, 3], (case, rows)
        assert all(abs(r["loss"] - b) <= TOL * b for r, b in zip(rows, res.losses)), (case, rows, res.losses)
        exported, meta = export_state_dict(tmp_path / "cases" / case / "ck")
        assert meta["mesh"]["tensor"] == 2 and set(exported) == set(res.state_dict), case
        worst = max((float((exported[k] - w).abs().max()), k) for k, w in res.state_dict.items())
        assert worst[0] <= TOL, (case, worst)


def test_init_from_gives_each_rank_its_part(configs, tmp_path):
    """--init-from a whole state_dict: each tensor rank copies its part of every split weight,
    and the first step is plain autograd's on those weights."""
    plan = plan_for("hf-gpt2", configs, stages=2, microbatches=2, slices="2,9,5", schedule="seq1f1b", tensor=2)
    trained, _ = fresh("hf-gpt2", configs)
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(1.5).add_(0.01)
    torch.save(trained.state_dict(), tmp_path / "w.pt")
    model, sliced = fresh("hf-gpt2", configs)
    opts = RunOptions(steps=1, init_from=str(tmp_path / "w.pt"), quiet=True)
    res = interpret(plan, opts, model=model, sliced=sliced,
                    checkpoints=RunCheckpoints.from_options(plan, opts, model=model))
    h = plan.header
    ref_loss, ref_grads, _ = batch_reference(trained, RandomTokens(0, h.shape.batch, SEQ, h.shape.vocab).get(0))
    worst, where = gradient_error(res.first_grads, ref_grads)
    assert worst <= TOL, (worst, where)
    assert abs(res.losses[0] - ref_loss) <= TOL * abs(ref_loss)


def test_the_commands_compile_and_run_a_tensor_axis(tmp_path, capsys, monkeypatch):
    """`tpc compile --tensor 2` then `tpc run --interpret --verify-grads`, as a user types them."""
    from tpc.cli.main import main

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    plan = tmp_path / "tp.tpir"
    assert main(["compile", model_file("llama"), "-o", str(plan), "--seq-len", "16", "--batch", "4", "--stages", "2",
                 "--dp", "2", "--tensor", "2", "--microbatches", "2", "--slices", "3", "-q"]) == 0
    assert "mesh pipe 2 data 2 tensor 2\n" in plan.read_text()
    assert main(["run", "--interpret", str(plan), "--steps", "2", "--verify-grads", "--grad-clip", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "step 2/2" in out and "|g|" in out and ": ok" in out.split("verify-grads:")[1], out


def test_sequence_parallel_messages_carry_a_ranks_tokens():
    """With `sequence-parallel` a message is a tensor rank's 1/T of the slice's tokens: the shape
    every receive is posted with (and the interpreter checks each message against)."""
    from tpc.ir.semantics import message_shape

    plain = real_plan("llama", stages=2, microbatches=2, slices="4,8,4", schedule="seq1f1b", seq_len=SEQ, tensor=2)
    split = real_plan("llama", stages=2, microbatches=2, slices="4,8,4", schedule="seq1f1b", seq_len=SEQ, tensor=2,
                      sequence=True)
    assert [message_shape(plain.header, 0, i, 32) for i in range(3)] == [(2, 4, 32), (2, 8, 32), (2, 4, 32)]
    assert [message_shape(split.header, 0, i, 32) for i in range(3)] == [(2, 2, 32), (2, 4, 32), (2, 2, 32)]
