"""torch.distributed.pipelining schedule CSVs in and out of tpc, without a model: every schedule
class of the installed torch (built with torch's own code, dumped with torch's `_dump_csv`)
imports and verifies; broken CSVs are reported at the right cell, next to what torch's own
checks (`_validate_schedule` in `_load_csv`, `_simulate_comms_compute`) say about them; the
export loads back into torch's `_PipelineScheduleRuntime` as the same actions."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
from torch.distributed.pipelining import schedules as S

from tests.compiler.torch_schedules import CASES, FORWARD_ONLY, LOADERS, build, concrete_classes, dump, leaf_actions, stage
from tpc.cli.main import main
from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule
from tpc.compiler.torch_schedule.actions import parse_csv
from tpc.compiler.torch_schedule.exporter import export_schedule, schedule_rows
from tpc.compiler.torch_schedule.importer import plan_from_schedule
from tpc.compiler.torch_schedule.layout import csv_header, layout_of
from tpc.compiler.torch_schedule.load import import_csv
from tpc.compiler.torch_schedule.slice_map import read_map
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Op
from tpc.ir.verify import verify

GRID = [(cls, case) for cls, cases in CASES.items() for case in cases]
RUNTIME = [(cls, case) for cls, case in GRID if issubclass(cls, S._PipelineScheduleRuntime)]


def _id(p):
    return p.__name__ if isinstance(p, type) else "x".join(map(str, p))


def errors(path) -> list:
    with pytest.raises(TpirError) as e:
        import_csv(str(path))
    return e.value.diagnostics


def write(tmp_path, name: str, rows: list[str]):
    path = tmp_path / name
    path.write_text("".join(r + "\r\n" for r in rows), encoding="utf-8")
    return path


def torch_checks(path, fmt: str, ranks: int, stages: int, microbatches: int) -> str:
    """What torch says of a CSV: `_PipelineScheduleRuntime._load_csv` (validates the action
    counts and order per stage, and for the compute-only form adds communication), then
    `_simulate_comms_compute` on the result (without UNSHARD/RESHARD/REDUCE_GRAD, which its
    simulator does not know). 'accepted' or the first check's exception."""
    rt = S._PipelineScheduleRuntime([stage(stages, ranks, 0, s) for s in range(0, stages, ranks)], microbatches)
    try:
        rt._load_csv(str(path), format=fmt)
        order = {r: [a for a in acts if a.computation_type not in (S.UNSHARD, S.RESHARD, S.REDUCE_GRAD)]
                 for r, acts in rt.pipeline_order_with_comms.items()}
        with contextlib.redirect_stdout(io.StringIO()):
            S._simulate_comms_compute(order, lambda s: rt.stage_index_to_group_rank[s], stages)
    except (AssertionError, ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "accepted"


# ------------------------------------------------------------------------------ the CSV text


def test_cells_know_where_they_are():
    sched = parse_csv('0F0,,"0F1" , (0F2; 1B0)OVERLAP_F_B\r\n1UNSHARD,1F0\r\n', "s.csv")
    row = sched.rows[0]
    assert [str(a) for a in row] == ["0F0", "0F1", "0F2", "1B0"]
    assert [(a.loc.line, a.loc.col, a.column) for a in row] == [(1, 1, 0), (1, 7, 2), (1, 15, 3), (1, 20, 3)]
    assert row[3].overlap == "(0F2; 1B0)OVERLAP_F_B"
    assert str(sched.rows[1][0]) == "1UNSHARD" and sched.rows[1][0].mb is None
    assert not sched.has_comms


def test_every_bad_cell_is_reported_at_once_where_it_is():
    with pytest.raises(TpirError) as e:
        parse_csv("0F0,0X1,0F\r\n1F0,1UNSHARD2,(1F1;1SEND_F1)OVERLAP_F_B,2F0x\r\n", "s.csv")
    got = [(d.loc.line, d.loc.col, d.message.split(" ")[0]) for d in e.value.diagnostics]
    assert got == [(1, 5, "`0X1`"), (1, 9, "`0F`"), (2, 5, "`1UNSHARD2`:"), (2, 20, "`1SEND_F1`"), (2, 41, "`2F0x`")]
    text = e.value.render()
    assert "s.csv:2:41: error: `2F0x` is not a torch pipelining action (rank 1, action 3)" in text
    assert "    2 | 1F0,1UNSHARD2,(1F1;1SEND_F1)OVERLAP_F_B,2F0x" in text


def test_a_stage_on_two_ranks_is_reported_at_the_second_cell(tmp_path):
    diags = errors(write(tmp_path, "s.csv", ["0F0,0B0", "1F0,0F1,1B0"]))
    assert (diags[0].loc.line, diags[0].loc.col) == (2, 5)
    assert "puts stage 0 on rank 1, but `0F0` at" in diags[0].message


# ------------------------------------------------------- every torch schedule class, verified


def test_every_schedule_class_of_this_torch_is_covered():
    assert concrete_classes() == set(CASES) | LOADERS | FORWARD_ONLY
    assert S._ScheduleForwardOnly(stage(2, 2), 2).pipeline_order is None  # nothing to import


@pytest.mark.parametrize("cls,case", [g for g in GRID if g[0] is not S.Schedule1F1B], ids=_id)
def test_torch_schedules_import_and_verify(tmp_path, cls, case):
    ranks, per_rank, mbs = case
    schedule = build(cls, *case)
    forms = ["compute_only"] + (["compute_comms"] if isinstance(schedule, S._PipelineScheduleRuntime) else [])
    for fmt in forms:
        imported = import_csv(str(dump(schedule, tmp_path / f"{fmt}.csv", fmt)))
        plan = imported.plan
        assert imported.comms_from_csv == (fmt == "compute_comms")
        assert (plan.header.mesh.pipe, plan.header.num_stages, len(plan.header.microbatches)) == (ranks, ranks * per_rank, mbs)
        assert verify(plan, "nccl") == []  # NCCL's rules: a GPU run of it cannot hang
        # the placement torch uses: interleaved (s mod p) or V (s and 2p-1-s on rank s)
        style = "v" if cls in (S.ScheduleZBVZeroBubble, S.ScheduleDualPipeV) else "loop"
        want = S.generate_stage_to_rank_mapping(ranks, ranks * per_rank, style=style)
        assert [st.rank for st in plan.header.stages] == [want[s] for s in range(ranks * per_rank)]
        # each computation of the plan is one of the CSV, in the CSV's order
        computes = {r: [i for i in p.instrs if i.op.value in ("forward", "backward", "backward-input", "backward-weight")]
                    for r, p in enumerate(plan.ranks)}
        kinds = {"forward": "F", "backward": "B", "backward-input": "I", "backward-weight": "W"}
        assert {r: [f"{i.stage}{kinds[i.op.value]}{i.mb}" for i in c] for r, c in computes.items()} == \
            leaf_actions(schedule.pipeline_order, compute_only=True)
        assert all(i.note.startswith("torch ") and i.loc.file.endswith(f"{fmt}.csv") for c in computes.values() for i in c)


def test_torchs_own_1f1b_order_is_off_by_one_on_the_last_rank(tmp_path):
    # Schedule1F1B._get_pipeline_order starts the last rank at F1 and ends it at F{M}: a
    # micro-batch that does not exist, and mb 0's backward without its forward. (Its runtime,
    # _step_microbatches, does not use this order: only dumps and visualisations do.)
    for ranks, _, mbs in CASES[S.Schedule1F1B]:
        path = dump(build(S.Schedule1F1B, ranks, 1, mbs), tmp_path / f"1f1b{ranks}.csv")
        last = path.read_text().splitlines()[-1].split(",")
        assert last[0] == f"{ranks - 1}F1"
        diags = errors(path)
        wrong = [d for d in diags if "names micro-batch" in d.message]
        col = path.read_text().splitlines()[-1].index(f"{ranks - 1}F{mbs}") + 1
        assert [(d.loc.line, d.loc.col) for d in wrong] == [(ranks, col)]
        assert any(d.message == f"no forward of stage {ranks - 1} mb 0 slice 0" and d.loc.line == ranks for d in diags)
        assert "without first running Forward" in torch_checks(path, "compute_only", ranks, ranks, mbs)


# ------------------------------------------------------------------ hand-broken schedules

# LoopedBFS on 2 ranks, 1 stage each, 2 micro-batches, as torch lowers it (compute + comms)
BFS = ["0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B1,0B1,0RECV_B0,0B0,0REDUCE_GRAD,0RESHARD",
       "1UNSHARD,1RECV_F0,1F0,1RECV_F1,1F1,1B1,1SEND_B1,1B0,1SEND_B0,1REDUCE_GRAD,1RESHARD"]


def test_the_base_schedule_of_the_broken_ones_is_torchs_own(tmp_path):
    path = dump(build(S.ScheduleLoopedBFS, 2, 1, 2), tmp_path / "bfs.csv", "compute_comms")
    assert path.read_text().splitlines() == BFS
    import_csv(str(path))
    assert torch_checks(path, "compute_comms", 2, 2, 2) == "accepted"


def test_a_swapped_send_is_reported_and_torch_accepts_it(tmp_path):
    # rank 0 sends mb 1's activation before mb 0's; rank 1 receives mb 0 first. Untagged, as
    # torch posts them, the two tensors are swapped: no hang, no error, wrong gradients.
    path = write(tmp_path, "swapped.csv", [BFS[0].replace("0F0,0SEND_F0,0F1,0SEND_F1", "0F0,0F1,0SEND_F1,0SEND_F0"), BFS[1]])
    [d] = errors(path)
    assert (d.loc.line, d.loc.col) == (2, 23)  # 1RECV_F1: the receive that takes the wrong message
    assert d.message.startswith("messages from rank 0 cross: this receive comes after cell 2:10 `1RECV_F0`")
    assert "cell 1:18 `0SEND_F1` (send act stage 0 mb 1 slice 0 to 1) before cell 1:27 `0SEND_F0`" in d.message
    assert torch_checks(path, "compute_comms", 2, 2, 2) == "accepted"


def test_a_missing_w_is_reported_and_torch_refuses_it(tmp_path):
    zb = dump(build(S.ScheduleInterleavedZeroBubble, 2, 1, 2), tmp_path / "zb.csv").read_text().splitlines()
    assert zb[1] == ",1F0,1I0,1F1,1I1,1W0,1W1"
    path = write(tmp_path, "missing_w.csv", [zb[0], ",1F0,1I0,1F1,1I1,1W0,"])
    [d] = errors(path)
    assert (d.loc.line, d.loc.col, d.message) == (2, 14, "backward-input of stage 1 mb 1 slice 0 has no backward-weight")
    assert "(torch `1W1`)" in d.hint
    assert "I and W must have equal counts" in torch_checks(path, "compute_only", 2, 2, 2)


def test_a_backward_before_its_forward_is_reported_and_torch_refuses_it(tmp_path):
    path = write(tmp_path, "b_first.csv", ["0F0,0F1,,,0B1,0B0", ",1B0,1F0,1F1,1B1"])
    [d] = errors(path)
    assert (d.loc.line, d.loc.col) == (2, 2)
    assert d.message == "backward stage 1 mb 0 slice 0 runs before cell 2:6 `1F0` (forward stage 1 mb 0 slice 0)"
    assert "without first running Forward" in torch_checks(path, "compute_only", 2, 2, 2)


def test_a_receive_that_waits_forever_is_reported_at_both_ends(tmp_path):
    path = write(tmp_path, "deadlock.csv", [BFS[0].replace("0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B1",
                                                           "0F0,0SEND_F0,0RECV_B1,0F1,0SEND_F1"), BFS[1]])
    diags = errors(path)
    assert [(d.loc.line, d.loc.col) for d in diags] == [(1, 23), (2, 23)]  # 0RECV_B1 and 1RECV_F1
    assert diags[0].message.startswith("not progressing (torch's `_simulate_comms_compute` raises \"Schedule is "
                                       "not progressing\"): rank 0 waits here forever for rank 1")
    assert "the send at cell 2:40 `1SEND_B1`" in diags[0].hint
    assert torch_checks(path, "compute_comms", 2, 2, 2).startswith("ValueError: Schedule is not progressing")


def test_a_gradient_received_before_its_activation_is_sent_is_not_progressing(tmp_path):
    """A compute+comms CSV has torch's semantics: a receive waits where it is written. Rank 0
    waits for mb 0's gradient before it sends mb 0's activation: torch's simulator stops
    ("not progressing"); NCCL lowering could pair the receive with the send after it into one
    exchange, and it was accepted so, running an order the CSV does not say."""
    path = write(tmp_path, "early_recv.csv", ["0F0,0RECV_B0,0SEND_F0,0B0", "1RECV_F0,1F0,1B0,1SEND_B0"])
    diags = errors(path)
    assert [(d.loc.line, d.loc.col) for d in diags] == [(1, 5), (2, 1)]  # 0RECV_B0 and 1RECV_F0
    assert all(d.message.startswith("not progressing (torch's") for d in diags)
    assert "the send at cell 2:18 `1SEND_B0`" in diags[0].hint and "a send never waits" in diags[0].hint
    assert torch_checks(path, "compute_comms", 2, 2, 1).startswith("ValueError: Schedule is not progressing")
    # written in the order torch runs, it is accepted by both
    fixed = write(tmp_path, "fixed.csv", ["0F0,0SEND_F0,0RECV_B0,0B0", "1RECV_F0,1F0,1B0,1SEND_B0"])
    import_csv(str(fixed))
    assert torch_checks(fixed, "compute_comms", 2, 2, 1) == "accepted"


def test_a_deadlock_of_tpcs_own_receives_is_said_at_the_computation(tmp_path):
    # compute only: rank 0 runs mb 0's backward before mb 1's forward, rank 1 wants mb 1's
    # forward first; tpc puts each receive right before the computation that needs it
    path = write(tmp_path, "cycle.csv", ["0F0,0B0,0F1,0B1", "1F1,1F0,1B0,1B1"])
    diags = errors(path)
    assert [(d.loc.line, d.loc.col) for d in diags] == [(1, 5), (2, 1)]
    assert diags[0].message.startswith("deadlock: rank 0 waits here forever for rank 1")
    assert "[`recv grad stage 0 mb 0 slice 0 from 1` is what tpc adds for cell 1:5 `0B0`]" in diags[0].message
    assert "waits for rank 1 cell 2:1 `1F1`, which waits for rank 0 cell 1:5 `0B0`" in diags[0].hint
    assert torch_checks(path, "compute_only", 2, 2, 2).startswith("AssertionError: Malformed compute schedule")


def test_fsdp_unshard_and_reshard_are_checked_as_torchs_runtime_asserts_them(tmp_path):
    path = write(tmp_path, "fsdp.csv", ["0UNSHARD,0F0,0UNSHARD,0F1,0RESHARD,0B0,0RESHARD,0B1",
                                        "1F0,1F1,1B0,1B1"])
    got = [(d.loc.col, d.message.split(" ")[1]) for d in errors(path)]
    assert got == [(14, "unshards"), (36, "computes"), (40, "reshards"), (49, "computes")]


def test_a_send_where_torch_would_send_nothing_is_refused_at_its_cell(tmp_path):
    diags = errors(write(tmp_path, "s.csv", ["0F0,0SEND_F0,0RECV_B0,0B0", "1RECV_F0,1F0,1SEND_F0,1B0,1SEND_B0"]))
    assert [(d.loc.line, d.loc.col) for d in diags] == [(2, 14)]
    assert "stage 1 is the last stage; it sends no activation" in diags[0].message


def test_reduce_grad_is_the_allreduce_where_the_csv_puts_it(tmp_path):
    path = write(tmp_path, "s.csv", ["0F0,0F1,0B0,0B1,0REDUCE_GRAD", "1F0,1F1,1B0,1REDUCE_GRAD,1B1"])
    sched = parse_csv(path.read_text(), str(path))
    header = csv_header(sched, layout_of(sched))
    two = dataclasses.replace(header, mesh=dataclasses.replace(header.mesh, data=2),
                              shape=dataclasses.replace(header.shape, batch=4))
    with pytest.raises(TpirError) as e:
        plan_from_schedule(sched, two)
    [d] = e.value.diagnostics
    assert (d.loc.line, d.loc.col) == (2, 13) and d.message.startswith("allreduce stage 1 runs before")
    fixed = write(tmp_path, "fixed.csv", ["0F0,0F1,0B0,0B1,0REDUCE_GRAD", "1F0,1F1,1B0,1B1"])
    sched = parse_csv(fixed.read_text(), str(fixed))
    plan = plan_from_schedule(sched, two).plan
    assert [str(i) for i in plan.ranks[0].instrs if i.op is Op.ALLREDUCE][0] == "allreduce stage 0"
    ops = [i.op for i in plan.ranks[0].instrs]
    last_backward = len(ops) - 1 - ops[::-1].index(Op.BACKWARD)
    assert ops.index(Op.ALLREDUCE) == last_backward + 1  # where the CSV put it: right after 0B1
    assert any(i.op is Op.ALLREDUCE for i in plan.ranks[1].instrs)  # placed by tpc: the CSV has none


# ------------------------------------------------------------------------------ export


@pytest.mark.parametrize("cls,case", [g for g in GRID if g[0] is not S.Schedule1F1B], ids=_id)
def test_export_loads_back_into_torch_as_the_same_actions(tmp_path, cls, case):
    ranks, per_rank, mbs = case
    schedule = build(cls, *case)
    plan = import_csv(str(dump(schedule, tmp_path / "in.csv"))).plan
    out = export_schedule(plan, str(tmp_path / "out.csv"))
    assert out.exact
    rt = S._PipelineScheduleRuntime([stage(ranks * per_rank, ranks, 0, s) for s in range(0, ranks * per_rank, ranks)], mbs)
    rt._load_csv(out.csv_path)  # validates, then lowers with torch's own _add_send_recv
    assert leaf_actions(rt.pipeline_order) == leaf_actions(schedule.pipeline_order, compute_only=True)


@pytest.mark.parametrize("cls,case", RUNTIME[::2], ids=_id)
def test_compute_and_comms_export_keeps_the_csvs_communication(tmp_path, cls, case):
    ranks, per_rank, mbs = case
    schedule = build(cls, *case)
    plan = import_csv(str(dump(schedule, tmp_path / "in.csv", "compute_comms"))).plan
    out = export_schedule(plan, str(tmp_path / "out.csv"), fmt="compute_comms")
    rt = S._PipelineScheduleRuntime([stage(ranks * per_rank, ranks, 0, s) for s in range(0, ranks * per_rank, ranks)], mbs)
    rt._load_csv(out.csv_path, format="compute_comms")
    assert leaf_actions(rt.pipeline_order_with_comms) == leaf_actions(schedule.pipeline_order_with_comms)
    reduced = [a for acts in rt.pipeline_order_with_comms.values() for a in acts if a.computation_type == S.REDUCE_GRAD]
    assert sorted(a.stage_index for a in reduced) == list(range(ranks * per_rank))
    assert torch_checks(out.csv_path, "compute_comms", ranks, ranks * per_rank, mbs) == "accepted"


def _sliced_plan():
    """A seq1f1b plan of the CSV-alone header: 2 stages, 2 micro-batches of 3 token slices."""
    sched = parse_csv("0F0,0B0\r\n1F0,1B0\r\n", "x.csv")
    header = csv_header(sched, layout_of(sched))
    from tpc.ir.nodes import Microbatch

    mbs = tuple(Microbatch(index=m, size=1, slices=((0, 2), (2, 5), (5, 6))) for m in range(2))
    header = dataclasses.replace(header, microbatches=mbs, shape=dataclasses.replace(header.shape, batch=2, seq=6))
    return lower(header, build_schedule("seq1f1b", header))


def test_token_slices_are_flattened_into_torch_micro_batches_and_come_back(tmp_path):
    plan = _sliced_plan()
    out = export_schedule(plan, str(tmp_path / "s.csv"), plan_name="plan.tpir")
    assert not out.exact
    info = json.loads((tmp_path / "s.csv.map.json").read_text())
    assert [(e["torch"], e["mb"], e["slice"], e["tokens"]) for e in info["torch_microbatches"]][:4] == \
        [(0, 0, 0, [0, 2]), (1, 0, 1, [2, 5]), (2, 0, 2, [5, 6]), (3, 1, 0, [0, 2])]
    assert any("left out" in n and "free-kv" in n for n in info["notes"])
    # torch loads it (and its own lowering finds a send/recv order for it)
    rt = S._PipelineScheduleRuntime([stage(2, 2)], 6)
    rt._load_csv(out.csv_path)
    # read back with the map beside it: the same slices, the same instructions
    again = import_csv(out.csv_path).plan
    assert again.header.microbatches == plan.header.microbatches
    assert [p.instrs for p in again.ranks] == [p.instrs for p in plan.ranks]
    assert read_map(out.map_path).units == ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2))


def test_a_slice_order_torch_cannot_see_is_reported_with_the_map(tmp_path):
    # swap two backwards of one micro-batch's slices: to torch, two independent micro-batches
    out = export_schedule(_sliced_plan(), str(tmp_path / "s.csv"))
    text = (tmp_path / "s.csv").read_text()
    row = text.splitlines()[1].split(",")
    a, b = row.index("1B2"), row.index("1B1")
    row[a], row[b] = row[b], row[a]
    (tmp_path / "s.csv").write_text(text.splitlines()[0] + "\r\n" + ",".join(row) + "\r\n")
    diags = errors(out.csv_path)
    assert any("slices are back-propagated in reverse token order" in d.hint and d.loc.line == 2 for d in diags)
    assert torch_checks(out.csv_path, "compute_only", 2, 2, 6) == "accepted"


@pytest.mark.parametrize("slices,message,hint", [
    ("[[0, -2], [-2, 5], [5, 6]]", "micro-batch 0: slice 0 [0, -2] names a negative token", "tokens are numbered 0..5"),
    ("[[0, 3], [2, 5], [5, 6]]", "micro-batch 0: slice 1 [2, 5] overlaps the slice before it, which ends at 3",
     "start slice 1 at token 3"),
    ("[[0, 2], [3, 5], [5, 6]]", "micro-batch 0: tokens 2:3 are in no slice (slice 1 is [3, 5])", "start slice 1 at token 2"),
    ("[[0, 2], [2, 5], [5, 9]]", "micro-batch 0: its slices end at token 9, but the map's seq is 6", "end the last slice at 6"),
    ("[[0, 2], [2, 2], [2, 6]]", "micro-batch 0: slice 1 [2, 2] holds no token", "end slice 1 after token 2, or remove it"),
    ("[[0, 2], [2, 5.5], [5.5, 6]]", "micro-batch entry 0 is malformed (5.5 is not an integer)", '"slices": [[0, T1]'),
])
def test_a_slice_map_with_a_bad_slice_is_refused_at_its_entry(tmp_path, capsys, slices, message, hint):
    """A hand-edited map beside a CSV: a negative, overlapping, missing or empty slice is refused
    at the map's entry (it was reported as a `header, microbatch line 0`, a line of no file)."""
    out = export_schedule(_sliced_plan(), str(tmp_path / "s.csv"))
    path = tmp_path / "s.csv.map.json"
    text = path.read_text()
    entry = '{"mb": 0, "rows": [0, 1], "slices": [[0, 2], [2, 5], [5, 6]]}'
    assert entry in text
    path.write_text(text.replace(entry, entry.replace("[[0, 2], [2, 5], [5, 6]]", slices)))
    assert main(["verify", out.csv_path]) == 1
    err = capsys.readouterr().err
    assert f"{path}:7:3: error: {message}\n" in err
    assert "    7 |   {\"mb\": 0," in err and hint in err


def test_a_slice_map_whose_torch_entries_disagree_is_refused_at_the_entry(tmp_path):
    out = export_schedule(_sliced_plan(), str(tmp_path / "s.csv"))
    path = tmp_path / "s.csv.map.json"
    text = path.read_text()
    path.write_text(text.replace('"torch": 4, "mb": 1, "slice": 1', '"torch": 4, "mb": 1, "slice": 0'))
    with pytest.raises(TpirError) as e:
        read_map(str(path))
    [d] = e.value.diagnostics
    assert (d.loc.line, d.loc.col) == (15, 3)
    assert d.message == "torch micro-batch 4 says tokens [2, 5], but slice 0 of micro-batch 1 is [0, 2]"
    path.write_text(text.replace('"rows": [1, 2], "slices"', '"rows": [2, 3], "slices"'))
    with pytest.raises(TpirError) as e:
        read_map(str(path))
    assert e.value.diagnostics[0].message == "micro-batch 1's rows [2, 3) do not start where the rows before it end, at 1"
    assert 'write "rows": [1, 2]' in e.value.diagnostics[0].hint


def test_export_refuses_recompute_and_says_where(tmp_path):
    plan = _sliced_plan()
    rank0 = list(plan.ranks[0].instrs)
    f = next(p for p, i in enumerate(rank0) if i.op is Op.FORWARD)
    rank0[f] = dataclasses.replace(rank0[f], checkpoint=True)
    ranks = (dataclasses.replace(plan.ranks[0], instrs=tuple(rank0)),) + plan.ranks[1:]
    with pytest.raises(TpirError) as e:
        schedule_rows(dataclasses.replace(plan, ranks=ranks))
    assert "has no action for `forward stage 0 mb 0 slice 0 checkpoint`" in e.value.render()
    assert "rank 0, instruction" in e.value.render()


def test_export_refuses_a_plan_with_weight_replicas():
    from tests.compiler import make_header
    from tpc.compiler.schedules import with_replicas

    h = with_replicas(make_header(4, mbs=4, schedule="chimera"))
    with pytest.raises(TpirError) as e:
        schedule_rows(lower(h, build_schedule("chimera", h)))
    assert "stage 0 has weight replicas on ranks 0, 3" in e.value.render()
    assert "one replica per stage" in e.value.render()


# ---------------------------------------------------------------------------- command line


def test_verify_and_simulate_a_csv_from_the_command_line(tmp_path, capsys):
    good = dump(build(S.ScheduleZBVZeroBubble, 2, 2, 4), tmp_path / "zbv.csv")
    assert main(["verify", str(good)]) == 0
    assert f"{good}: ok (2 ranks, 4 stages, 114 instructions)" in capsys.readouterr().out
    assert main(["simulate", str(good), "--unit"]) == 0
    out = capsys.readouterr().out
    assert "4 stages on 2 ranks, 4 micro-batches" in out and "bubble" in out
    assert main(["simulate", str(good), "--device-model", "h100"]) == 1
    assert "a torch schedule with no model: only unit costs can price it" in capsys.readouterr().err
    bad = write(tmp_path, "bad.csv", ["0F0,0F1,,,0B1,0B0", ",1B0,1F0,1F1,1B1"])
    assert main(["verify", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:2:2: error: backward stage 1 mb 0 slice 0 runs before cell 2:6 `1F0`" in err
    assert "    2 | ,1B0,1F0,1F1,1B1\n      |  ^" in err


def test_export_schedule_from_the_command_line(tmp_path, capsys):
    from tpc.ir.printer import print_plan

    (tmp_path / "p.tpir").write_text(print_plan(_sliced_plan()))
    assert main(["export-schedule", str(tmp_path / "p.tpir"), "-o", str(tmp_path / "s.csv"),
                 "--format", "compute_comms"]) == 0
    assert "token slices written as torch micro-batches" in capsys.readouterr().out
    assert (tmp_path / "s.csv").read_text().startswith("0F0,0SEND_F0,0F1,0SEND_F1,")
    assert main(["verify", str(tmp_path / "s.csv")]) == 0


def test_compile_refuses_a_schedule_choice_beside_a_schedule_file(tmp_path, capsys):
    csv = write(tmp_path, "s.csv", ["0F0,0B0", "1F0,1B0"])
    assert main(["compile", "model.py", "-o", str(tmp_path / "p.tpir"), "--seq-len", "8", "--batch", "2",
                 "--schedule-file", str(csv), "--schedule", "1f1b"]) == 1
    assert "--schedule with --schedule-file" in capsys.readouterr().err


@pytest.mark.parametrize("rows,cell", [
    (["0F0,0F1,,,0B1,0B0,0F999999", ",1F0,1F1,1B1,1B0"], "1:19"),  # 1.2 GB and no end, before
    (["0F0,0F1,,,0B1,0B0", ",1F0,1F1,1B1,1B0,999999999F0"], "2:18"),
    (["0F0,0F1,,,0B1,0B0,0F100000000000000000000", ",1F0,1F1,1B1,1B0"], "1:19"),
])
def test_a_huge_stage_or_micro_batch_number_is_refused_at_its_cell(tmp_path, capsys, rows, cell):
    """Every size read from a CSV is bounded before anything is sized by it: a stray huge
    number in an otherwise valid file is refused at its cell, at once (a stray `0F999999` in
    rank 0's row made `tpc verify` run without end while its memory grew)."""
    import time

    bad = write(tmp_path, "huge.csv", rows)
    started = time.monotonic()
    assert main(["verify", str(bad)]) == 1
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert f"{bad}:{cell}: error: " in err
    assert "is beyond any schedule this file could hold: it has 9 actions" in err
