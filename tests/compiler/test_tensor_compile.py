"""`tpc compile --tensor T`: the plan's mesh gets a tensor axis, every stage's split is found (and a
degree the model cannot split is refused at its line) at compile, the cost models price a stage
split over T ranks (compute / T, the tensor group's all-reduces added), and the plan search
covers pipeline x data x tensor."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tpc.cli.main import main
from tpc.compiler.options import check_options
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import FORMAT_VERSION

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TINY = str(Path(__file__).parent / "models" / "tiny_gpt.py")
SMALL = ["--seq-len", "16", "--batch", "2", "--stages", "2"]


@pytest.mark.parametrize("example", ["nanogpt", "llama"])
def test_an_example_compiles_with_a_tensor_axis_and_verifies(example, tmp_path, capsys):
    from tpc.ir.verify import verify_file

    out = tmp_path / "plan.tpir"
    assert main(["compile", str(EXAMPLES / f"{example}.py"), "-o", str(out), *SMALL, "--tensor", "2"]) == 0
    text = out.read_text()
    assert text.startswith(f"tpir {FORMAT_VERSION}\n") and "\nmesh pipe 2 data 1 tensor 2\n" in text
    plan = verify_file(str(out))
    assert (plan.header.mesh.pipe, plan.header.mesh.data, plan.header.mesh.tensor) == (2, 1, 2)
    assert plan.header.mesh.value.size == 4
    captured = capsys.readouterr()
    assert "x 2 tensor ranks" in captured.out
    assert "  tensor " in captured.err and "column" in captured.err  # the split of each stage, found
    assert main(["verify", str(out)]) == 0


def test_tensor_one_is_no_axis_and_no_pass(tmp_path, capsys):
    from tpc.compiler.pipeline import compile_passes

    out = tmp_path / "plan.tpir"
    assert main(["compile", TINY, "-o", str(out), *SMALL, "--tensor", "1", "-q"]) == 0
    assert "\nmesh pipe 2 data 1\n" in out.read_text()
    names = [p.name for p in compile_passes(check_options(seq_len=16, batch=2, tensor=1))]
    assert "tensor" not in names
    assert "tensor" in [p.name for p in compile_passes(check_options(seq_len=16, batch=2, tensor=2))]


def test_a_degree_that_does_not_divide_is_refused_at_compile_naming_the_dimension_and_the_line(tmp_path, capsys):
    out = tmp_path / "plan.tpir"
    assert main(["compile", str(EXAMPLES / "nanogpt.py"), "-o", str(out), *SMALL, "--tensor", "3"]) == 1
    err = capsys.readouterr().err
    assert "nanogpt.py:103:" in err and "cannot split for tensor degree 3" in err
    assert "3 does not divide the vocabulary, of size 256" in err
    assert not out.exists()
    # 8 divides the vocabulary but not the 4 heads: refused at the line that cuts q into heads
    assert main(["compile", str(EXAMPLES / "llama.py"), "-o", str(out), *SMALL, "--tensor", "8"]) == 1
    err = capsys.readouterr().err
    assert "llama.py:65:" in err and "8 does not divide dimension 2 of the result (the heads" in err
    assert "of size 4" in err


@pytest.mark.parametrize("given, words", [
    (dict(tensor=0), "--tensor must be a positive whole number"),
    (dict(tensor="two"), "--tensor 'two' is not a number"),
    (dict(tensor="auto"), "--tensor auto lets the plan search split --ranks"),
    (dict(tensor=2, ranks=3), "--ranks 3 does not match --stages 2 x --dp 1 x --tensor 2 = 4"),
    (dict(tensor=3, ranks=8, stages="auto", device_model="h100"), "--tensor 3 does not divide --ranks 8"),
])
def test_bad_tensor_options_are_refused_before_tracing(given, words):
    with pytest.raises(TpirError) as e:
        check_options(**{"seq_len": 16, "batch": 4, **given})
    assert words in str(e.value)


def test_ranks_count_the_tensor_axis():
    o = check_options(seq_len=16, batch=4, stages=2, dp=2, tensor=2, ranks=8)
    assert (o.pipe, o.data, o.tensor_size) == (2, 2, 2)
    o = check_options(seq_len=16, batch=4, stages=4, tensor=2, ranks=4)  # 2 stages on each of 2 pipeline ranks
    assert (o.pipe, o.chunks) == (2, 2)


# ------------------------------------------------------------------------------ the cost models


@pytest.fixture(scope="module")
def tiny_sliced():
    from tpc.compiler.frontend import SlicedModel, load_model, read_vocab

    model = load_model(TINY, "model")
    return SlicedModel.from_model(model, seq_len=64, vocab=read_vocab(model, TINY))


def test_the_graph_model_divides_the_compute_by_t_and_adds_the_tensor_all_reduces(tiny_sliced):
    """Without launch and host costs a stage's time is its roofline alone: at T = 2, half of
    it, plus two all-reduces of the activation per layer each way (and one for the embedding)."""
    from tpc.compiler.costmodel.devices import V100
    from tpc.compiler.costmodel.graph import GraphCostModel, GraphCosts

    device = dataclasses.replace(V100, launch_overhead=0.0, host_op_time=0.0)
    costs = GraphCosts.from_sliced(tiny_sliced)
    ranges = [(0, 2), (2, 4)]  # embedding + block 0 | block 1 + head
    one, two = GraphCostModel(device, costs, ranges), GraphCostModel(device, costs, ranges, tensor=2)
    l, c, b = 32, 16, 2
    ar = device.group_allreduce_time(l * b * costs.hidden * costs.float_bytes, 2)
    assert ar > 0
    for stage, (n_fwd, n_bwd) in enumerate([(3, 2), (2, 2)]):  # the embedding's all-reduce on stage 0
        f1, b1 = one.slice_time(stage, l, c, b)
        f2, b2 = two.slice_time(stage, l, c, b)
        assert f2 == pytest.approx(f1 / 2 + n_fwd * ar) and b2 == pytest.approx(b1 / 2 + n_bwd * ar)
        assert f2 - n_fwd * ar < f1 and b2 - n_bwd * ar < b1
        assert two.param_bytes(stage) == pytest.approx(one.param_bytes(stage) / 2, abs=1)
        assert two.kv_bytes(stage, l, b) == pytest.approx(one.kv_bytes(stage, l, b) / 2, abs=1)
        assert two.activation_bytes(l, b) == one.activation_bytes(l, b)  # every rank holds it whole
    assert "tensor 2" in two.describe()


def test_a_measured_profile_is_divided_by_t_with_the_collectives_on_its_link():
    from tests.compiler.costmodel import synthetic
    from tpc.compiler.costmodel.profiled import ProfiledCostModel

    profile = synthetic.tiny_gpt_profile("0" * 64)
    ranges = [(0, 2), (2, 4)]
    one, two = ProfiledCostModel(profile, ranges), ProfiledCostModel(profile, ranges, tensor=2)
    l, c, b = 16, 8, 2
    ar = one.allreduce_time(one.activation_bytes(l, b), 2)
    assert ar > 0
    for stage, (n_fwd, n_bwd) in enumerate([(3, 2), (2, 2)]):
        f1, b1 = one.slice_time(stage, l, c, b)
        f2, b2 = two.slice_time(stage, l, c, b)
        assert f2 == pytest.approx(f1 / 2 + n_fwd * ar) and b2 == pytest.approx(b1 / 2 + n_bwd * ar)
        t_in, t_w = two.split_backward_time(stage, l, c, b)
        assert t_in + t_w == pytest.approx(b2)  # the backward's all-reduces ride on its input half
        assert two.param_bytes(stage) == one.param_bytes(stage) // 2


def test_the_tensor_groups_all_reduce_is_a_ring_on_the_nodes_link():
    """The formula the analytic model's `op` degree and the graph model's tensor split share."""
    from tpc.compiler.costmodel.devices import V100

    d, n = V100, 1e6
    assert d.group_allreduce_time(n, 1) == 0
    assert d.group_allreduce_time(n, 8) == pytest.approx(
        d.launch_overhead + 14 * d.intra_node_latency + 2 * 7 / 8 * n / d.intra_node_bandwidth)
    across = d.group_allreduce_time(n, 16)  # two nodes: the network, at the collective efficiency
    assert across == pytest.approx(d.launch_overhead + 30 * d.inter_node_latency
                                   + 2 * 15 / 16 * n / (d.inter_node_bandwidth * d.collective_efficiency))


def test_a_cost_source_splits_per_degree_once(tmp_path):
    from tests.compiler.costmodel import synthetic
    from tpc.compiler.costmodel.resolve import load_cost_source
    from tpc.compiler.costmodel.store import save_profile

    path = tmp_path / "p.msgpack"
    save_profile(synthetic.tiny_gpt_profile("0" * 64), path)
    source = load_cost_source(cost=str(path), num_units=4)
    two = source.split(2)
    assert source.split(1) is source and source.split(2) is two and two.split(1) is source
    assert two.for_stages([(0, 2), (2, 4)]).tensor == 2


def test_compile_with_a_profile_and_tensor_2(tmp_path, tiny_sliced):
    from tests.compiler.costmodel import synthetic
    from tpc.compiler.costmodel.store import save_profile
    from tpc.compiler.frontend import file_sha256

    path = tmp_path / "p.msgpack"
    save_profile(synthetic.tiny_gpt_profile(file_sha256(TINY)), path)
    out = tmp_path / "plan.tpir"
    assert main(["compile", TINY, "-o", str(out), "--seq-len", "64", "--batch", "4", "--stages", "2",
                 "--microbatches", "2", "--slices", "auto", "--cost", str(path), "--tensor", "2", "-q"]) == 0
    assert "\nmesh pipe 2 data 1 tensor 2\n" in out.read_text()


# ------------------------------------------------------------------------------ the search


def test_meshes_for_ranks_cover_pipeline_x_data_x_tensor():
    from tpc.compiler.optimise.search import meshes_for_ranks

    meshes, skipped = meshes_for_ranks(8, 6, 8, 1, tensors=(1, 2, 4, 3))
    assert meshes == [(1, 8, 1), (2, 4, 1), (4, 2, 1), (1, 4, 2), (2, 2, 2), (4, 1, 2), (1, 2, 4), (2, 1, 4)]
    assert skipped == ["8x1: 8 stages but the model has 6 units"]
    assert meshes_for_ranks(4, 6, 4, 1) == ([(1, 4, 1), (2, 2, 1), (4, 1, 1)], [])  # no tensor axis


def test_tensor_auto_searches_every_accepted_degree_and_explains(tmp_path, capsys):
    out = tmp_path / "plan.tpir"
    argv = ["compile", str(EXAMPLES / "nanogpt.py"), "-o", str(out), "--seq-len", "32", "--batch", "8",
            "--stages", "auto", "--ranks", "8", "--tensor", "auto", "--device-model", "h100",
            "--slices", "auto", "--microbatches", "2", "--schedule", "seq1f1b", "--explain"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "mesh (PxDxT)" in err
    for mesh in ("2x4 ", "4x2 ", "1x4x2", "2x2x2", "4x1x2", "1x2x4", "2x1x4"):
        assert f" {mesh}" in err
    # 8 does not divide nanoGPT's 4 heads: not searched, and why
    assert "not searched: tensor 8: cannot split for tensor degree 8" in err
    from tpc.ir.parse import parse

    h = parse(out.read_text()).header
    chosen = next(line for line in err.splitlines() if line.startswith("chosen:"))
    assert (h.mesh.tensor != 1) == ("tensor ranks" in chosen)
    assert h.mesh.value.size == 8


def test_a_fixed_tensor_degree_with_stages_auto_splits_the_rest(tmp_path, capsys):
    out = tmp_path / "plan.tpir"
    assert main(["compile", str(EXAMPLES / "nanogpt.py"), "-o", str(out), "--seq-len", "32", "--batch", "4",
                 "--stages", "auto", "--ranks", "4", "--tensor", "2", "--device-model", "h100",
                 "--slices", "2", "--microbatches", "2", "--schedule", "seq1f1b", "--explain"]) == 0
    err = capsys.readouterr().err
    assert " 1x2x2" in err and " 2x1x2" in err and " 4x1 " not in err
    assert out.read_text().count("tensor 2\n") == 1


def test_sequence_parallel_is_written_on_the_mesh_line_and_checked(tmp_path, capsys):
    """`--sequence-parallel` (with --tensor T): the mesh line says so (format version 5); without
    a tensor axis, or with a slice T does not divide, refused before the model is traced."""
    out = tmp_path / "plan.tpir"
    assert main(["compile", str(EXAMPLES / "nanogpt.py"), "-o", str(out), *SMALL, "--tensor", "2",
                 "--sequence-parallel", "--slices", "4,8,4", "-q"]) == 0
    assert "\nmesh pipe 2 data 1 tensor 2 sequence-parallel\n" in out.read_text()
    assert main(["verify", str(out)]) == 0
    capsys.readouterr()
    with pytest.raises(TpirError, match=r"there are none \(--tensor 1\)"):
        check_options(seq_len=16, batch=2, sequence_parallel=True)
    with pytest.raises(TpirError, match="slice 0:5 has 5 tokens, which the 2 tensor ranks"):
        check_options(seq_len=16, batch=2, tensor=2, sequence_parallel=True, slices="5,11")


def test_the_simulator_prices_a_sequence_parallel_plans_messages_at_1_over_t(tmp_path):
    """`plan_cost_model` of a `sequence-parallel` plan: transfers and received messages are a
    tensor rank's 1/T of a slice's tokens; the compute is the split model's own."""
    from tpc.compiler.costmodel.resolve import plan_cost_model
    from tpc.ir.verify import verify_file

    costs = {}
    for sp in (False, True):
        out = tmp_path / f"plan{sp}.tpir"
        assert main(["compile", str(EXAMPLES / "nanogpt.py"), "-o", str(out), *SMALL, "--tensor", "2",
                     "--slices", "4,8,4", "-q", *(["--sequence-parallel"] if sp else [])]) == 0
        costs[sp] = plan_cost_model(verify_file(str(out)).header, device_model="h100")
    plain, split = costs[False], costs[True]
    assert split.p2p_time(1 << 20) == pytest.approx(plain.p2p_time(1 << 19))
    assert split.message_bytes(8, 2) == pytest.approx(plain.message_bytes(8, 2) / 2)
    assert split.slice_time(0, 8, 0, 2) == plain.slice_time(0, 8, 0, 2)
    assert split.describe().endswith("sequence-parallel")


@pytest.mark.parametrize("schedule,comm", [("terapipe", "nccl"), ("gpipe", "gloo"), ("seq1f1b", "nccl"),
                                           ("1f1b", "nccl")])
def test_tensor_overlap_brings_the_forwards_and_backwards_of_slice_pairs_together(schedule, comm, tmp_path,
                                                                                   capsys):
    """`--tensor-overlap`: where only the send of slice i's output and the receive of slice i + 1's
    input stand between their forwards (of slice i's input gradient and slice i - 1's output
    gradient between their backwards), the receive moves up and the send down (`pair_slices`);
    the plan verifies under the rules it was lowered for, and its schedule line says so."""
    from tpc.compiler.lowering.lower import PAIRED_NOTE, paired as pair_of
    from tpc.executors.engine import paired_backwards
    from tpc.ir.nodes import Op
    from tpc.ir.verify import verify_file

    out, plain = tmp_path / "paired.tpir", tmp_path / "plain.tpir"
    args = ["compile", str(EXAMPLES / "nanogpt.py"), *SMALL, "--tensor", "2", "--slices", "4", "--microbatches",
            "2", "--schedule", schedule, "--comm", comm, "-q"]
    assert main([*args, "-o", str(plain)]) == 0 and main([*args, "--tensor-overlap", "-o", str(out)]) == 0
    assert PAIRED_NOTE in out.read_text() and PAIRED_NOTE not in plain.read_text()
    assert main(["verify", str(out), "--comm", comm]) == 0
    paired, before = verify_file(str(out)), verify_file(str(plain))
    for prog, old in zip(paired.ranks, before.ranks):
        assert sorted(map(str, prog.instrs)) == sorted(map(str, old.instrs))  # the same instructions, moved
        pairs, p = [], 0
        while p + 1 < len(prog.instrs):  # as the executors take them: in stream order, none in two pairs
            a, b = prog.instrs[p], prog.instrs[p + 1]
            paired_here = pair_of(a, b) is not None
            pairs += [(a, b)] if paired_here else []
            p += 2 if paired_here else 1
        if schedule in ("terapipe", "gpipe"):  # every compute is paired: nothing else comes between them
            forwards = [(a, b) for a, b in pairs if a.op is Op.FORWARD]
            backwards = [(a, b) for a, b in pairs if a.op is Op.BACKWARD]
            assert len(forwards) == len(backwards) == 2 * 2  # 2 micro-batches x 2 pairs each
            assert all(a.slice % 2 == 0 for a, _ in forwards) and all(a.slice % 2 == 1 for a, _ in backwards)
            assert all(b.key == (a.stage, a.mb, a.slice - 1) for a, b in backwards)
    # the stages whose backwards are paired run their traced programs (what a pair of backwards is
    # made of); the plain plan's run eagerly
    if schedule in ("terapipe", "gpipe"):  # (1F1B's streams may hold adjacent backwards unasked)
        assert paired_backwards(verify_file(str(out))) == {0, 1}
        assert paired_backwards(verify_file(str(plain))) == set()
    with pytest.raises(TpirError, match=r"--tensor-overlap overlaps the tensor-parallel collectives"):
        check_options(seq_len=16, batch=2, tensor_overlap=True)
