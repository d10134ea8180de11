"""`tpc compile` reaches every schedule: several stages per pipeline rank (`--virtual-stages V`,
or `--stages K --ranks R` with R / dp dividing K) in the placement the schedule is made for, and
activation recomputation (`--recompute none|full|auto`) as plan instructions. Each plan trains
exactly as plain autograd through the reference interpreter (`--verify-grads`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpc.cli.compile import check_options
from tpc.cli.main import main
from tpc.compiler.compile import compile_plan
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Op
from tpc.ir.parse import parse

TINY = str(Path(__file__).parent / "models" / "tiny_gpt.py")  # 4 units
SHAPE = ["--seq-len", "16", "--batch", "4", "--microbatches", "2", "-q"]


def compile_cli(tmp_path, name: str, *args: str) -> Path:
    out = tmp_path / name
    assert main(["compile", TINY, "-o", str(out), *SHAPE, *args]) == 0
    return out


def exact(plan: Path, capsys) -> None:
    capsys.readouterr()
    assert main(["run", "--interpret", str(plan), "--verify-grads", "-q"]) == 0
    assert "tolerance 1e-05: ok" in capsys.readouterr().out


@pytest.mark.parametrize("schedule", ["interleaved", "looped-bfs", "seq-interleaved", "zb-h1", "seq-zb"])
def test_virtual_stages_loop_the_stages_over_the_ranks(tmp_path, capsys, schedule):
    a = compile_cli(tmp_path, "a.tpir", "--schedule", schedule, "--stages", "2", "--virtual-stages", "2",
                    "--slices", "5,3,8")
    b = compile_cli(tmp_path, "b.tpir", "--schedule", schedule, "--stages", "4", "--ranks", "2",
                    "--slices", "5,3,8")
    assert a.read_text() == b.read_text()  # the two spellings are one plan
    h = parse(a.read_text()).header
    assert (h.mesh.pipe, h.num_stages) == (2, 4) and [st.rank for st in h.stages] == [0, 1, 0, 1]
    exact(a, capsys)


def test_virtual_stages_with_data_parallel_replicas(tmp_path, capsys):
    plan = compile_cli(tmp_path, "p.tpir", "--schedule", "interleaved", "--stages", "4", "--ranks", "4",
                       "--dp", "2", "--slices", "3")
    h = parse(plan.read_text()).header
    assert (h.mesh.pipe, h.mesh.data, [st.rank for st in h.stages]) == (2, 2, [0, 1, 0, 1])
    exact(plan, capsys)


def test_recompute_full_checkpoints_every_forward_and_recomputes_before_its_backward(tmp_path, capsys):
    plan = compile_cli(tmp_path, "r.tpir", "--schedule", "zb-h1", "--stages", "2", "--slices", "3",
                       "--recompute", "full")
    p = parse(plan.read_text())
    for rank in p.ranks:
        fwd = [i for i in rank.instrs if i.op is Op.FORWARD]
        rec = [(i.stage, i.mb, i.slice) for i in rank.instrs if i.op is Op.RECOMPUTE]
        assert fwd and all(i.checkpoint for i in fwd)
        assert sorted(rec) == sorted((i.stage, i.mb, i.slice) for i in fwd)
    exact(plan, capsys)
    none = parse(compile_cli(tmp_path, "n.tpir", "--schedule", "zb-h1", "--stages", "2", "--slices", "3").read_text())
    assert not any(i.op is Op.RECOMPUTE or getattr(i, "checkpoint", False) for r in none.ranks for i in r.instrs)


def test_recompute_auto_recomputes_the_stages_over_the_budget_and_says_so(tmp_path, capsys):
    from tpc.compiler.costmodel.resolve import load_cost_source
    from tpc.compiler.frontend import SlicedModel, load_model, read_vocab
    from tpc.compiler.predict.memory import rank_memory

    args = ["--schedule", "1f1b", "--stages", "4", "--slices", "2", "--device-model", "a100"]
    free = parse(compile_cli(tmp_path, "f.tpir", *args).read_text())
    model = load_model(TINY, "model")
    sliced = SlicedModel.from_model(model, seq_len=16, vocab=read_vocab(model, TINY), check_slices=None)
    costs = load_cost_source(cost=None, device_model="a100", sliced=sliced, num_units=sliced.num_units,
                             model_sha256=None).for_stages([st.units for st in free.header.stages])

    def peaks(plan):
        return [rank_memory(plan.header, r.rank, r.instrs, costs).peak.total for r in plan.ranks]

    before = peaks(free)
    budget = max(before) - 1  # the middle ranks (1f1b holds most there) are over it
    capsys.readouterr()
    out = tmp_path / "a.tpir"
    assert main(["compile", TINY, "-o", str(out), *SHAPE[:-1], *args, "--recompute", "auto",
                 "--memory-per-rank", str(int(budget)), "--explain"]) == 0
    err = capsys.readouterr().err
    plan = parse(out.read_text())
    over = {r for r, b in enumerate(before) if b > budget}
    recomputed = {i.stage for r in plan.ranks for i in r.instrs if i.op is Op.RECOMPUTE}
    assert len(over) == 2 and recomputed == over  # one stage per rank: exactly those over the budget
    assert all(p <= budget for p in peaks(plan))
    assert f"auto: stages {', '.join(map(str, sorted(over)))} recomputed" in err
    assert "recompute auto, budget" in err and f"rank {min(over)}: stages {min(over)}: peak " in err
    exact(out, capsys)


@pytest.mark.parametrize("change, where, words", [
    (dict(schedule="1f1b", virtual_stages=2), "--virtual-stages", "one stage per rank needs as many stages as ranks"),
    (dict(schedule="interleaved", stages="4", ranks=3), "--ranks", "--ranks 3 does not match --stages 4 x --dp 1 = 4"),
    (dict(schedule="interleaved", virtual_stages=2, ranks=4), "--ranks", "--virtual-stages 2 puts 2 stages on each"),
    (dict(schedule="interleaved", virtual_stages=2, device_model="a100"), "--virtual-stages", "the plan search places one stage per rank"),
    (dict(recompute="auto"), "--recompute", "--recompute auto chooses per stage what to recompute"),
    (dict(recompute="auto", memory_per_rank="1GiB"), "--recompute", "priced by a cost model"),
    (dict(recompute="some"), "--recompute", "--recompute 'some' is not a choice"),
    (dict(virtual_stages=0), "--virtual-stages", "--virtual-stages must be a positive whole number"),
    (dict(schedule="interleaved", virtual_stages=3), "--virtual-stages", "6 stages but the model has only 4 partition units"),
])
def test_bad_chunk_and_recompute_options_are_refused_at_the_option(change, where, words):
    opts = dict(stages="2", microbatches=2, seq_len=16, batch=4, slices="1", schedule="seq1f1b", quiet=True)
    with pytest.raises(TpirError) as e:
        compile_plan(TINY, check_options(**{**opts, **change}))
    [d] = e.value.diagnostics
    assert d.where == where and words in d.message + " " + (d.hint or ""), e.value.render()
    assert d.hint


def test_a_schedule_file_fixes_the_chunks_and_leaves_no_recompute_choice(tmp_path, capsys):
    from torch.distributed.pipelining import schedules as S

    from tests.compiler.torch_schedules import build, dump

    csv = dump(build(S.ScheduleInterleaved1F1B, 2, 2, 2), tmp_path / "il.csv")
    for extra in (["--virtual-stages", "2"], ["--recompute", "full"]):
        out = tmp_path / "p.tpir"
        assert main(["compile", TINY, "-o", str(out), "--seq-len", "16", "--batch", "4", "--schedule-file",
                     str(csv), *extra]) == 1
        err = capsys.readouterr().err
        assert f"{extra[0]}: error: {extra[0]} with --schedule-file: the schedule file fixes" in err and "hint:" in err
        assert not out.exists()
