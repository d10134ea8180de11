"""The verifier: valid plans verify clean; each rule, broken alone, gives its located error.

Negative tests edit the plan of docs/ir.md (copied below as EXAMPLE so line numbers are fixed)
or a plan built by `build_plan`, then assert the message and the line of every diagnostic.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import (
    Header,
    Instr,
    MeshLine,
    Microbatch,
    ModelLine,
    Op,
    Payload,
    Plan,
    RankProgram,
    ScheduleLine,
    ShapeLine,
    Stage,
    Tie,
    UnitsLine,
)
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.semantics import GLOO
from tpc.ir.verify import check, verify, verify_file

ROOT = Path(__file__).resolve().parents[2]

# docs/ir.md's example; line numbers in the tests below refer to this text
EXAMPLE = """\
# A 2-stage plan: one micro-batch of 4 rows, cut into two token slices of unequal length.
tpir 1
model "examples/gpt.py" sha256 "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b" factory "model"
shape batch 4 seq 64 vocab 256 dtype float32
mesh pipe 2 data 1
schedule "terapipe"
units 6
stage 0 rank 0 units 0:3 "transformer.wte .. transformer.h.0"
stage 1 rank 1 units 3:6 "transformer.h.1 .. lm_head"
tie "transformer.wte.weight" stages 0 1
microbatch 0 size 4 slices 0:40 40:64

rank 0
  load mb 0
  forward stage 0 mb 0 slice 0
  send act stage 0 mb 0 slice 0 to 1
  forward stage 0 mb 0 slice 1
  send act stage 0 mb 0 slice 1 to 1
  recv grad stage 0 mb 0 slice 1 from 1
  backward stage 0 mb 0 slice 1
  recv grad stage 0 mb 0 slice 0 from 1
  backward stage 0 mb 0 slice 0  # the last backward frees nothing: the KV cache goes below
  free-kv stage 0 mb 0
  reduce-tied "transformer.wte.weight"
  step

rank 1
  load mb 0
  recv act stage 1 mb 0 slice 0 from 0
  forward stage 1 mb 0 slice 0
  recv act stage 1 mb 0 slice 1 from 0
  forward stage 1 mb 0 slice 1
  backward stage 1 mb 0 slice 1
  send grad stage 1 mb 0 slice 1 to 0
  backward stage 1 mb 0 slice 0
  send grad stage 1 mb 0 slice 0 to 0
  free-kv stage 1 mb 0
  reduce-tied "transformer.wte.weight"
  step
"""

FILE = "plan.tpir"


# ------------------------------------------------------------------------------ helpers


def lines_of(text: str) -> list[str]:
    return text.splitlines()


def replace(text: str, n: int, new: str) -> str:
    """Line n (from 1) replaced by `new`, an instruction (indented) or a header line."""
    lines = lines_of(text)
    lines[n - 1] = ("  " + new) if lines[n - 1].startswith("  ") else new
    return "\n".join(lines) + "\n"


def delete(text: str, *ns: int) -> str:
    lines = [ln for k, ln in enumerate(lines_of(text), 1) if k not in ns]
    return "\n".join(lines) + "\n"


def insert(text: str, n: int, new: str) -> str:
    """`new` (an instruction) inserted so that it becomes line n."""
    lines = lines_of(text)
    lines.insert(n - 1, "  " + new)
    return "\n".join(lines) + "\n"


def move(text: str, src: int, dst: int) -> str:
    """Line src moved so that it becomes line dst."""
    lines = lines_of(text)
    line = lines.pop(src - 1)
    lines.insert(dst - 1, line)
    return "\n".join(lines) + "\n"


def diags_of(text: str):
    """The diagnostics under gloo's rules, the format's own (a crossing of receives is also a
    deadlock under NCCL's, which these tests of the other rules leave out)."""
    return verify(parse(text, file=FILE), GLOO)


def found(text: str) -> list[tuple[int, str, str]]:
    """(line, message, hint) of every diagnostic, in the order the verifier gives them."""
    out = []
    for d in diags_of(text):
        assert d.loc is not None and d.loc.file == FILE, d
        out.append((d.loc.line, d.message, d.hint))
    return out


def expect(text: str, *wanted: tuple[int, str]) -> list[tuple[int, str, str]]:
    """The diagnostics are exactly one per (line, fragment) in `wanted`, each message or hint
    containing its fragment."""
    got = found(text)
    assert [line for line, _, _ in got] == sorted(line for line, _ in wanted), got
    remaining = list(got)
    for line, fragment in wanted:
        match = [g for g in remaining if g[0] == line and (fragment in g[1] or fragment in g[2])]
        assert match, f"no diagnostic at line {line} with {fragment!r} in {got}"
        remaining.remove(match[0])
    return got


# -------------------------------------------------------------------- a small plan builder


def build_plan(
    placement=(0, 1),
    slices=((0, 3), (3, 8)),
    mbs=2,
    data=1,
    split=False,
    checkpoint=False,
    ties=(),
    free_kv=True,
) -> Plan:
    """A valid plan in global order: every forward by (mb, slice, stage), then every backward by
    (mb, reverse slice, reverse stage); a rank runs its share in that order, so no rank can wait
    on one that waits on it. Split backward runs all weight passes after the input passes."""
    k, pipe = len(placement), max(placement) + 1
    seq = slices[-1][1]
    header = Header(
        model=ModelLine(path="m.py", sha256="0" * 64, factory="model"),
        shape=ShapeLine(batch=2 * mbs * data, seq=seq, vocab=16),
        mesh=MeshLine(pipe=pipe, data=data),
        schedule=ScheduleLine(name="gpipe"),
        units=UnitsLine(count=k),
        stages=tuple(Stage(index=s, rank=placement[s], units=(s, s + 1)) for s in range(k)),
        ties=tuple(Tie(name=n, stages=sts) for n, sts in ties),
        microbatches=tuple(Microbatch(index=m, size=2, slices=tuple(slices)) for m in range(mbs)),
    )
    n = len(slices)
    streams: dict[int, list[Instr]] = {r: [] for r in range(pipe)}
    loaded: set[tuple[int, int]] = set()
    for m in range(mbs):
        for i in range(n):
            for s in range(k):
                r = placement[s]
                out = streams[r]
                if s in (0, k - 1) and (r, m) not in loaded:
                    loaded.add((r, m))
                    out.append(Instr(Op.LOAD, mb=m))
                if s > 0 and placement[s - 1] != r:
                    out.append(Instr(Op.RECV, s, m, i, Payload.ACT, placement[s - 1]))
                out.append(Instr(Op.FORWARD, s, m, i, checkpoint=checkpoint))
                if s < k - 1 and placement[s + 1] != r:
                    out.append(Instr(Op.SEND, s, m, i, Payload.ACT, placement[s + 1]))
    for m in range(mbs):
        for i in reversed(range(n)):
            for s in reversed(range(k)):
                r = placement[s]
                out = streams[r]
                if s < k - 1 and placement[s + 1] != r:
                    out.append(Instr(Op.RECV, s, m, i, Payload.GRAD, placement[s + 1]))
                if checkpoint:
                    out.append(Instr(Op.RECOMPUTE, s, m, i))
                out.append(Instr(Op.BACKWARD_INPUT if split else Op.BACKWARD, s, m, i))
                if s > 0 and placement[s - 1] != r:
                    out.append(Instr(Op.SEND, s, m, i, Payload.GRAD, placement[s - 1]))
    for s in range(k):
        out = streams[placement[s]]
        for m in range(mbs):
            if split:
                out += [Instr(Op.BACKWARD_WEIGHT, s, m, i) for i in range(n)]
            if free_kv:
                out.append(Instr(Op.FREE_KV, s, m))
    for s in range(k):
        if data > 1:
            streams[placement[s]].append(Instr(Op.ALLREDUCE, s))
    for name, sts in sorted(ties):
        ranks = {placement[s] for s in sts}
        if len(ranks) > 1:
            for r in sorted(ranks):
                streams[r].append(Instr(Op.REDUCE_TIED, tie=name))
    for r in range(pipe):
        streams[r].append(Instr(Op.STEP))
    return Plan(header, tuple(RankProgram(rank=r, instrs=tuple(streams[r])) for r in range(pipe)))


def text_of(plan: Plan) -> str:
    return print_plan(plan)


def line_of(text: str, instr: str, rank: int | None = None) -> int:
    """The line number of an instruction's text (in the section of `rank`, if given)."""
    current = None
    for n, line in enumerate(lines_of(text), 1):
        if line.startswith("rank "):
            current = int(line.split()[1])
        if line.strip() == instr and (rank is None or rank == current):
            return n
    raise LookupError(instr)


# ------------------------------------------------------------------------------ valid plans


def test_docs_example_verifies_clean():
    doc = (ROOT / "docs" / "ir.md").read_text(encoding="utf-8")
    block = re.search(r"```\n(# A 2-stage.*?)```", doc, re.S).group(1)
    assert verify(parse(block, file="docs/ir.md")) == []
    assert verify(parse(EXAMPLE, file=FILE)) == []


VALID = {
    "two ranks": dict(),
    "one stage": dict(placement=(0,)),
    "data parallel": dict(data=2, mbs=3),
    "two stages on one rank": dict(placement=(0, 0, 1)),
    "interleaved": dict(placement=(0, 1, 0, 1), ties=(("emb", (0, 3)),)),
    "split backward": dict(placement=(0, 1, 2), split=True),
    "checkpoint and recompute": dict(checkpoint=True, placement=(0, 1, 1)),
    "ties across ranks": dict(placement=(0, 1, 2), ties=(("emb", (0, 2)), ("b", (1, 2)))),
    "tie on one rank": dict(placement=(0, 0, 1), ties=(("emb", (0, 1)),)),
    "no free-kv": dict(free_kv=False),
    "unequal slices": dict(slices=((0, 1), (1, 5), (5, 6), (6, 13)), mbs=1),
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_built_plans_verify_clean(name):
    plan = build_plan(**VALID[name])
    assert verify(plan) == []
    assert check(plan) is plan
    text = text_of(plan)
    assert verify(parse(text, file=FILE)) == []


GOLDEN = sorted(glob.glob(str(ROOT / "tests" / "**" / "golden" / "*.tpir"), recursive=True))


@pytest.mark.parametrize("path", GOLDEN, ids=[os.path.relpath(p, ROOT) for p in GOLDEN])
def test_golden_files_verify_clean(path):
    plan = verify_file(path)
    assert plan.ranks


# ------------------------------------------------------------------------------ header rules


def test_model_digest_and_dtype():
    expect(EXAMPLE.replace('sha256 "6b86', 'sha256 "zz86'), (3, "is not a SHA-256 digest"))
    expect(EXAMPLE.replace("dtype float32", "dtype float31"), (4, "unknown dtype float31"))


def test_stage_numbered_out_of_order():
    got = expect(replace(EXAMPLE, 9, 'stage 2 rank 1 units 3:6 "x"'),
                 (9, "stage 2 is listed where stage 1 belongs"))
    assert "write `stage 1` here" in got[0][2]


def test_stage_on_a_rank_outside_the_mesh():
    expect(replace(EXAMPLE, 9, 'stage 1 rank 2 units 3:6 "x"'),
           (9, "stage 1 is placed on rank 2, but the mesh has pipeline ranks 0..1"))


def test_rank_without_stage():
    text = EXAMPLE.replace("mesh pipe 2", "mesh pipe 3") + "\nrank 2\n  step\n"
    got = expect(text, (5, "pipeline rank 2 holds no stage"))
    assert "lower `mesh pipe`" in got[0][2]


def test_units_gap_overlap_and_end():
    expect(replace(EXAMPLE, 9, 'stage 1 rank 1 units 4:6 "x"'),
           (9, "units 3:4 belong to no stage"))
    expect(replace(EXAMPLE, 9, 'stage 1 rank 1 units 2:6 "x"'),
           (9, "overlap the previous stage, which ends at 3"))
    expect(replace(EXAMPLE, 7, "units 7"),
           (9, "the stages end at unit 6, but the model has 7 units"))
    expect(replace(replace(EXAMPLE, 9, 'stage 1 rank 1 units 3:3 "x"'), 7, "units 3"),
           (9, "stage 1 has no units (3:3)"))


def test_tie_with_missing_or_single_stage():
    # reduce-tied lines naming a malformed tie are not checked again: one error each
    expect(replace(EXAMPLE, 10, 'tie "transformer.wte.weight" stages 0 5'),
           (10, "names stage 5, which does not exist"))
    expect(replace(EXAMPLE, 10, 'tie "transformer.wte.weight" stages 1 1'),
           (10, "fewer than two distinct stages"))
    twice = EXAMPLE.replace("microbatch 0", 'tie "transformer.wte.weight" stages 0 1\nmicrobatch 0')
    expect(twice, (11, 'tie "transformer.wte.weight" is declared twice'))


def test_microbatch_sizes_and_slices():
    expect(replace(EXAMPLE, 11, "microbatch 0 size 3 slices 0:40 40:64"),
           (11, "micro-batch sizes sum to 3, but each replica's batch is 4 rows"))
    expect(replace(EXAMPLE, 11, "microbatch 0 size 4 slices 0:40 41:64"),
           (11, "tokens 40:41 are in no slice"))
    expect(replace(EXAMPLE, 11, "microbatch 0 size 4 slices 0:40 39:64"),
           (11, "overlaps the slice before it"))
    expect(replace(EXAMPLE, 11, "microbatch 0 size 4 slices 0:40 40:60"),
           (11, "the slices end at token 60, but seq is 64"))


def test_microbatch_with_empty_slice():
    # the empty slice is slice 1; the instructions for slices 1, 2 are then also off
    got = found(replace(EXAMPLE, 11, "microbatch 0 size 4 slices 0:40 40:40 40:64"))
    assert (11, "microbatch 0: slice 1 (40:40) is empty") in [(g[0], g[1]) for g in got]


def test_microbatch_of_size_zero():
    got = found(replace(EXAMPLE, 11, "microbatch 0 size 0 slices 0:40 40:64"))
    assert [(g[0], g[1]) for g in got] == [
        (11, "microbatch 0 has size 0"),
        (11, "micro-batch sizes sum to 0, but each replica's batch is 4 rows (batch 4 / data 1)"),
    ]


def test_microbatches_numbered_out_of_order():
    expect(replace(EXAMPLE, 11, "microbatch 1 size 4 slices 0:40 40:64"),
           (11, "microbatch 1 is listed where microbatch 0 belongs"))


def test_batch_not_divisible_by_data():
    text = text_of(build_plan(data=2, mbs=1))  # batch 4, data 2
    n = next(k for k, line in enumerate(lines_of(text), 1) if line.startswith("shape batch 4 "))
    expect(text.replace("shape batch 4 ", "shape batch 5 "),
           (n, "batch 5 is not divisible by `mesh data 2`"))


def test_format_version_and_missing_rank_section_in_memory():
    plan = parse(EXAMPLE, file=FILE)
    v9 = dataclasses.replace(plan, header=dataclasses.replace(plan.header, version=9))
    [d] = verify(v9)
    assert d.loc.line == 2 and d.message == "unknown format version 9"
    assert "tpir 6" in d.hint and "1, 2, 3, 4" in d.hint
    short = dataclasses.replace(plan, ranks=plan.ranks[:1])
    [d] = verify(short)
    assert d.loc.line == 5 and "(missing: 1)" in d.message


def test_rank_sections_missing_or_extra():
    expect(delete(EXAMPLE, *range(26, 40)),
           (5, "the mesh has 2 pipeline ranks, but the plan has 1 rank sections (missing: 1)"))
    expect(EXAMPLE + "\nrank 2\n  step\n",
           (41, "rank 2 section, but the mesh has 2 pipeline ranks"))

def test_rank_sections_out_of_order_in_memory():
    plan = build_plan()
    swapped = dataclasses.replace(plan, ranks=(plan.ranks[1], plan.ranks[0]))
    got = verify(swapped)
    assert [d.where for d in got] == ["rank section 0", "rank section 1"]
    assert got[0].message == "rank 1 section where the section of rank 0 belongs"


# ---------------------------------------------------------------------------- operand rules


def test_stage_that_does_not_exist():
    expect(replace(EXAMPLE, 15, "forward stage 5 mb 0 slice 0"),
           (13, "no forward of stage 0 mb 0 slice 0"),
           (15, "stage 5 does not exist"))


def test_microbatch_and_slice_that_do_not_exist():
    expect(replace(EXAMPLE, 14, "load mb 3"),
           (13, "rank 0 never loads micro-batch 0"),
           (14, "micro-batch 3 does not exist"))
    expect(replace(EXAMPLE, 17, "forward stage 0 mb 0 slice 2"),
           (13, "no forward of stage 0 mb 0 slice 1"),
           (17, "micro-batch 0 has no slice 2"))


def test_instruction_on_the_wrong_rank():
    got = expect(replace(EXAMPLE, 30, "forward stage 0 mb 0 slice 0"),
                 (27, "no forward of stage 1 mb 0 slice 0"),
                 (30, "stage 0 is held by rank 0, not by rank 1"))
    assert "move this line to the section of rank 0" in got[1][2]


def test_load_on_a_middle_rank():
    text = text_of(build_plan(placement=(0, 1, 2), mbs=1))
    n = line_of(text, "rank 1") + 1
    expect(insert(text, n, "load mb 0"), (n, "rank 1 holds neither the first nor the last stage"))


def test_send_to_the_wrong_peer_and_to_a_missing_rank():
    got = expect(replace(EXAMPLE, 16, "send act stage 0 mb 0 slice 0 to 0"),
                 (16, "stage 1 is on rank 1, not rank 0"),
                 (29, "rank 0 never sends this message"))
    assert got[0][2] == "write `to 1`"
    expect(replace(EXAMPLE, 16, "send act stage 0 mb 0 slice 0 to 7"),
           (16, "rank 7 does not exist"),
           (29, "rank 0 never sends this message"))


def test_send_between_stages_of_one_rank_is_forbidden():
    text = text_of(build_plan(placement=(0, 0, 1), mbs=1))
    n = line_of(text, "forward stage 0 mb 0 slice 0") + 1
    expect(insert(text, n, "send act stage 0 mb 0 slice 0 to 0"),
           (n, "stages 0 and 1 are both on rank 0: no send between them"))


def test_last_stage_sends_no_activation():
    expect(insert(EXAMPLE, 31, "send act stage 1 mb 0 slice 0 to 0"),
           (31, "the last stage sends no activation"))


def test_allreduce_without_data_parallelism():
    expect(insert(EXAMPLE, 24, "allreduce stage 0"),
           (24, "allreduce with `mesh data 1`"))


def test_reduce_tied_rules():
    text = text_of(build_plan(placement=(0, 1, 2), mbs=1, ties=(("emb", (0, 2)),)))
    n = line_of(text, "step", rank=1)
    expect(insert(text, n, 'reduce-tied "emb"'), (n, 'rank 1 holds no stage of tie "emb"'))
    text = text_of(build_plan(placement=(0, 0, 1), mbs=1, ties=(("emb", (0, 1)),)))
    n = line_of(text, "step", rank=0)
    expect(insert(text, n, 'reduce-tied "emb"'),
           (n, 'every stage of tie "emb" is on rank 0: there is nothing to reduce'))
    expect(replace(EXAMPLE, 24, 'reduce-tied "nope"'),
           (13, 'rank 0 never reduces tie "transformer.wte.weight"'),
           (24, 'no tie named "nope"'))


# ----------------------------------------------------------------------- completeness rules


def test_duplicate_forward_names_both_lines():
    got = expect(insert(EXAMPLE, 18, "forward stage 0 mb 0 slice 1"),
                 (18, "duplicate instruction: the same one is at line 17"))
    assert got[0][2] == "remove one of the two"


def test_missing_backward():
    got = expect(delete(EXAMPLE, 20), (13, "no backward of stage 0 mb 0 slice 1"))
    assert "add `backward stage 0 mb 0 slice 1` to rank 0, below line 17" in got[0][2]


def test_backward_mixed_with_split_backward():
    expect(insert(EXAMPLE, 34, "backward-input stage 1 mb 0 slice 1"),
           (34, "has both a backward (line 33) and a split backward"))


def test_split_backward_half_missing():
    expect(replace(EXAMPLE, 33, "backward-input stage 1 mb 0 slice 1"),
           (33, "backward-input of stage 1 mb 0 slice 1 has no backward-weight"))
    expect(replace(EXAMPLE, 33, "backward-weight stage 1 mb 0 slice 1"),
           (33, "backward-weight of stage 1 mb 0 slice 1 has no backward-input"))


def test_checkpoint_without_recompute_and_recompute_without_checkpoint():
    got = expect(replace(EXAMPLE, 30, "forward stage 1 mb 0 slice 0 checkpoint"),
                 (30, "checkpoint forward of stage 1 mb 0 slice 0 is never recomputed"))
    assert "above line 35 (backward stage 1 mb 0 slice 0)" in got[0][2]
    expect(insert(EXAMPLE, 35, "recompute stage 1 mb 0 slice 0"),
           (35, "whose forward (line 30) is not a checkpoint forward"))


def test_missing_and_duplicate_load():
    expect(delete(EXAMPLE, 28), (27, "rank 1 never loads micro-batch 0"))
    expect(insert(EXAMPLE, 15, "load mb 0"), (15, "duplicate instruction: the same one is at line 14"))


def test_send_and_receive_both_missing():
    got = expect(delete(EXAMPLE, 16, 29),
                 (13, "the activation of stage 0 mb 0 slice 0 never goes to rank 1 (stage 1)"))
    assert "below line 15 (forward stage 0 mb 0 slice 0)" in got[0][2]
    assert "above line 28 (forward stage 1 mb 0 slice 0)" in got[0][2]


def test_send_without_receive_and_receive_without_send():
    got = expect(delete(EXAMPLE, 29), (16, "nothing on rank 1 receives this message"))
    assert "add `recv act stage 1 mb 0 slice 0 from 0` to rank 1 above line 29" in got[0][2]
    got = expect(delete(EXAMPLE, 16), (28, "rank 0 never sends this message"))
    assert "add `send act stage 0 mb 0 slice 0 to 1` to rank 0 below line 15" in got[0][2]
    expect(delete(EXAMPLE, 34), (19, "nothing on rank 1 receives this message".replace(
        "nothing on rank 1 receives", "rank 1 never sends")))


def test_duplicate_send():
    expect(insert(EXAMPLE, 17, "send act stage 0 mb 0 slice 0 to 1"),
           (17, "duplicate instruction: the same one is at line 16"))


def test_free_kv_twice():
    expect(insert(EXAMPLE, 24, "free-kv stage 0 mb 0"),
           (24, "duplicate instruction: the same one is at line 23"))


def test_allreduce_missing_and_duplicate():
    text = text_of(build_plan(data=2, mbs=1))
    n = line_of(text, "allreduce stage 1")
    got = expect(delete(text, n), (line_of(text, "rank 1"), "stage 1 is never all-reduced"))
    assert "add `allreduce stage 1` to rank 1" in got[0][2]
    expect(insert(text, n, "allreduce stage 1"),
           (n + 1, f"duplicate instruction: the same one is at line {n}"))


def test_reduce_tied_missing():
    expect(delete(EXAMPLE, 38), (27, 'rank 1 never reduces tie "transformer.wte.weight"'))


def test_step_missing_and_twice():
    expect(delete(EXAMPLE, 25), (13, "rank 0 never runs `step`"))
    expect(insert(EXAMPLE, 25, "step"), (26, "duplicate instruction: the same one is at line 25"))


# ----------------------------------------------------------------------------- order rules


def test_forward_before_the_previous_slice():
    got = expect(move(EXAMPLE, 17, 15),
                 (15, "forward stage 0 mb 0 slice 1 runs before line 16 (forward stage 0 mb 0 slice 0)"))
    assert got[0][2] == ("slice 1 attends to the KV cache of slice 0; move this line below line 16")


def test_forward_before_its_receive():
    expect(move(EXAMPLE, 30, 29),
           (29, "forward stage 1 mb 0 slice 0 runs before line 30 (recv act stage 1 mb 0 slice 0 from 0)"))


def test_forward_before_the_previous_stage_on_the_same_rank():
    text = text_of(build_plan(placement=(0, 0, 1), mbs=1))
    a = line_of(text, "forward stage 0 mb 0 slice 0")
    b = line_of(text, "forward stage 1 mb 0 slice 0")
    assert b == a + 1
    expect(move(text, b, a),
           (a, f"forward stage 1 mb 0 slice 0 runs before line {b} (forward stage 0 mb 0 slice 0)"))


def test_forward_before_load():
    got = expect(move(EXAMPLE, 14, 15), (14, "runs before line 15 (load mb 0)"))
    assert "token ids" in got[0][2]
    got = expect(move(EXAMPLE, 28, 30), (29, "runs before line 30 (load mb 0)"))
    assert "targets" in got[0][2]


def test_backward_before_its_forward():
    expect(move(EXAMPLE, 33, 32),
           (32, "backward stage 1 mb 0 slice 1 runs before line 33 (forward stage 1 mb 0 slice 1)"))


def test_backward_in_token_order_instead_of_reverse():
    got = expect(move(EXAMPLE, 35, 33),
                 (33, "backward stage 1 mb 0 slice 0 runs before line 34 (backward stage 1 mb 0 slice 1)"))
    assert "reverse token order" in got[0][2] and got[0][2].endswith("move this line below line 34")


def test_backward_before_its_gradient_arrives():
    expect(move(EXAMPLE, 20, 19),
           (19, "backward stage 0 mb 0 slice 1 runs before line 20 (recv grad stage 0 mb 0 slice 1 from 1)"))


def test_backward_before_the_next_stage_on_the_same_rank():
    text = text_of(build_plan(placement=(0, 0, 1), mbs=1, slices=((0, 8),)))
    a = line_of(text, "backward stage 1 mb 0 slice 0")
    b = line_of(text, "backward stage 0 mb 0 slice 0")
    assert b == a + 1
    expect(move(text, b, a),
           (a, f"backward stage 0 mb 0 slice 0 runs before line {b} (backward stage 1 mb 0 slice 0)"))


def test_recompute_out_of_place():
    text = text_of(build_plan(checkpoint=True, mbs=1, slices=((0, 8),)))
    rec = line_of(text, "recompute stage 1 mb 0 slice 0")
    bwd = line_of(text, "backward stage 1 mb 0 slice 0")
    assert bwd == rec + 1
    expect(move(text, rec, bwd),
           (rec, f"backward stage 1 mb 0 slice 0 runs before line {bwd} (recompute stage 1 mb 0 slice 0)"))
    fwd = line_of(text, "forward stage 1 mb 0 slice 0 checkpoint")
    expect(move(text, rec, fwd),
           (fwd, f"recompute stage 1 mb 0 slice 0 runs before line {fwd + 1} (forward stage 1"))


def test_backward_weight_before_backward_input():
    text = text_of(build_plan(split=True, mbs=1, slices=((0, 8),)))
    w = line_of(text, "backward-weight stage 1 mb 0 slice 0")
    i = line_of(text, "backward-input stage 1 mb 0 slice 0")
    expect(move(text, w, i),
           (i, f"backward-weight stage 1 mb 0 slice 0 runs before line {i + 1} (backward-input"))


def test_send_before_the_compute_that_produces_it():
    expect(move(EXAMPLE, 16, 15),
           (15, "send act stage 0 mb 0 slice 0 to 1 runs before line 16 (forward stage 0 mb 0 slice 0)"))
    expect(move(EXAMPLE, 34, 33),
           (33, "send grad stage 1 mb 0 slice 1 to 0 runs before line 34 (backward stage 1 mb 0 slice 1)"))


def test_free_kv_too_early():
    got = expect(move(EXAMPLE, 23, 22),
                 (22, "free-kv stage 0 mb 0 runs before it is done with the KV cache of stage 0 "
                      "mb 0, which line 23 (backward stage 0 mb 0 slice 0) still uses"))
    assert got[0][2] == "move this line below line 23"


def test_allreduce_before_the_last_backward():
    text = text_of(build_plan(data=2, mbs=1, free_kv=False))
    a = line_of(text, "allreduce stage 0")
    b = line_of(text, "backward stage 0 mb 0 slice 0")
    expect(move(text, a, b),
           (b, f"allreduce stage 0 runs before it is done with the gradients of stage 0, to "
               f"which line {b + 1} (backward stage 0 mb 0 slice 0) still adds"))


def test_reduce_tied_before_the_last_backward():
    expect(move(EXAMPLE, 24, 22),
           (22, 'reduce-tied "transformer.wte.weight" runs before it is done with the gradient '
                'of tie "transformer.wte.weight", to which line 23 (backward stage 0 mb 0 slice 0)'))


def test_step_before_the_last_reduction():
    got = expect(move(EXAMPLE, 39, 38),
                 (38, 'step runs before it is done with the parameters of rank 1, which line 39 '
                      '(reduce-tied "transformer.wte.weight") still uses'))
    assert got[0][2] == "move this line below line 39"


# ---------------------------------------------------------------------- FIFO and deadlock


def test_receives_that_cross_their_sends():
    got = expect(move(EXAMPLE, 31, 29),
                 (30, "messages from rank 0 cross: this receive comes after line 29 (recv act "
                      "stage 1 mb 0 slice 1 from 0), but rank 0 sends this one first: line 16"))
    assert "before line 18 (send act stage 0 mb 0 slice 1 to 1)" in got[0][1]
    assert "move this line above line 29" in got[0][2]


DEADLOCK = EXAMPLE.replace(
    """\
  send act stage 0 mb 0 slice 0 to 1
  forward stage 0 mb 0 slice 1
  send act stage 0 mb 0 slice 1 to 1
  recv grad stage 0 mb 0 slice 1 from 1
""",
    """\
  forward stage 0 mb 0 slice 1
  recv grad stage 0 mb 0 slice 1 from 1
  send act stage 0 mb 0 slice 0 to 1
  send act stage 0 mb 0 slice 1 to 1
""",
)


def test_deadlock_names_every_stuck_rank_and_the_cycle():
    assert DEADLOCK != EXAMPLE
    got = expect(DEADLOCK,
                 (17, "deadlock: rank 0 waits here forever for rank 1"),
                 (29, "deadlock: rank 1 waits here forever for rank 0"))
    assert got[0][2].startswith("rank 0 line 17 waits for rank 1 line 29, which waits for rank 0 line 17")
    assert got[1][2].startswith("rank 1 line 29 waits for rank 0 line 17, which waits for rank 1 line 29")
    assert "the send at line 18 (send act stage 0 mb 0 slice 0 to 1) must run before rank 0 blocks at line 17" in got[1][2]


def test_deadlock_on_reduce_tied():
    # rank 0 reaches reduce-tied before sending its activations; rank 1 waits for them
    text = move(EXAMPLE, 24, 15)  # reduce-tied right after load; also out of order (R10)
    got = found(text)
    lines = [(g[0], g[1]) for g in got]
    assert (15, 'deadlock: rank 0 waits here forever for rank(s) 1 to reach reduce-tied '
                '"transformer.wte.weight"') in lines
    assert (29, "deadlock: rank 1 waits here forever for rank 0, which never reaches its "
                "matching send") in lines


def test_no_deadlock_check_when_sends_do_not_match():
    # rank 1 would wait for a send that does not exist: a matching error, not a deadlock
    got = found(delete(DEADLOCK, 18))
    assert not any("deadlock" in g[1] for g in got)
    assert (28, "rank 0 never sends this message") in [(g[0], g[1]) for g in got]


# ---------------------------------------------------------------------- reporting


def test_independent_errors_are_all_reported_in_line_order():
    text = move(delete(EXAMPLE, 25), 34, 32)  # no step on rank 0; backward order on rank 1
    expect(text,
           (13, "rank 0 never runs `step`"),
           (32, "backward stage 1 mb 0 slice 0 runs before line 33 (backward stage 1 mb 0 slice 1)"))


def test_in_memory_plans_name_rank_and_instruction():
    plan = build_plan(mbs=1, slices=((0, 8),))
    r1 = plan.ranks[1]
    instrs = list(r1.instrs)
    f = next(k for k, ins in enumerate(instrs) if ins.op is Op.FORWARD)
    instrs[f - 1], instrs[f] = instrs[f], instrs[f - 1]  # forward above its receive
    broken = dataclasses.replace(plan, ranks=(plan.ranks[0], dataclasses.replace(r1, instrs=tuple(instrs))))
    [d] = verify(broken)
    assert d.loc is None
    assert d.where == f"rank 1, instruction {f - 1} (forward stage 1 mb 0 slice 0)"
    assert d.hint.endswith(f"move this line below rank 1, instruction {f}")
    with pytest.raises(TpirError) as err:
        check(broken)
    assert err.value.diagnostics == [d]
    assert str(err.value).startswith(f"rank 1, instruction {f - 1} (forward stage 1 mb 0 slice 0): error:")


def test_verify_file_renders_location_source_line_and_caret(tmp_path):
    path = tmp_path / "bad.tpir"
    path.write_text(move(EXAMPLE, 35, 33), encoding="utf-8")
    with pytest.raises(TpirError) as err:
        verify_file(str(path))
    assert err.value.source is not None
    out = err.value.render().splitlines()
    assert out[0] == (f"{path}:33:3: error: backward stage 1 mb 0 slice 0 runs before line 34 "
                      "(backward stage 1 mb 0 slice 1)")
    assert out[1] == "   33 |   backward stage 1 mb 0 slice 0"
    assert out[2] == "      |   ^"
    assert out[3].startswith("  hint: slices are back-propagated in reverse token order")


def test_verify_file_returns_the_plan_and_refuses_a_missing_file(tmp_path):
    path = tmp_path / "ok.tpir"
    path.write_text(EXAMPLE, encoding="utf-8")
    assert verify_file(str(path)) == parse(EXAMPLE, file=str(path))
    with pytest.raises(TpirError) as err:
        verify_file(str(tmp_path / "nope.tpir"))
    assert "no such file" in err.value.render()


# --------------------------------------------------------------------- robustness property

BASE = text_of(build_plan(placement=(0, 1, 0), mbs=2, slices=((0, 3), (3, 8)), data=2,
                          split=True, ties=(("emb", (0, 2)),)))
BASE_LINES = lines_of(BASE)


def _mutate(lines: list[str], kind: str, a: int, b: int, delta: int) -> list[str]:
    out = list(lines)
    if kind == "swap":
        out[a], out[b] = out[b], out[a]
    elif kind == "delete":
        del out[a]
    else:  # change the k-th number of line a
        numbers = list(re.finditer(r"\d+", out[a]))
        if numbers:
            n = numbers[b % len(numbers)]
            value = max(0, int(n.group()) + delta)
            out[a] = out[a][: n.start()] + str(value) + out[a][n.end():]
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["swap", "delete", "number"]),
    a=st.integers(0, len(BASE_LINES) - 1),
    b=st.integers(0, len(BASE_LINES) - 1),
    delta=st.integers(-3, 3),
)
def test_single_line_mutations_give_located_diagnostics_or_verify_clean(kind, a, b, delta):
    assert verify(parse(BASE, file=FILE)) == []
    lines = _mutate(BASE_LINES, kind, a, b, delta)
    text = "\n".join(lines) + "\n"
    try:
        diags = verify(parse(text, file=FILE))
    except TpirError as e:  # a parse error: located as well
        diags = e.diagnostics
    for d in diags:
        assert d.loc is not None and d.loc.file == FILE, d
        assert 1 <= d.loc.line <= max(len(lines), 1), d
        assert d.message and d.hint, d


# ------------------------------------------------------- an independent oracle: execution


def runs_cleanly(plan: Plan) -> bool:
    """Execute a plan's streams on abstract state, the way an executor would, and say whether
    every instruction finds what it needs: the KV cache alive, its input and output gradient
    present, the message it receives at the head of its FIFO channel, and parameters not yet
    reduced or stepped. Written as state, not as the verifier's rules, so that the two views
    of the format can be compared. For plans whose instruction multiset is complete."""
    h = plan.header
    k = h.num_stages
    rank_of = [st.rank for st in h.stages]
    tie_ranks = {t.name: {rank_of[s] for s in t.stages} for t in h.ties}
    # (rank, stage) -> the ties across ranks that stage's weight gradient feeds
    ties_of = {}
    for t in h.ties:
        if len(tie_ranks[t.name]) > 1:
            for s in t.stages:
                ties_of.setdefault((rank_of[s], s), []).append(t.name)
    done: set = set()  # ("f"|"r"|"b"|"bi"|"bw", s, m, i)
    have: set = set()  # ("act"|"grad", s, m, i): the input / output gradient of (s, m, i) is here
    loaded, freed, reduced, stepped, tie_done = set(), set(), set(), set(), set()
    arrived: dict = {}
    chan: dict = {}  # (src, dst) -> list of messages in flight
    ptr = [0] * len(plan.ranks)
    nslices = [len(mb.slices) for mb in h.microbatches]

    def weights_open(r, s):
        return s not in reduced and r not in stepped and not any(
            (r, t) in tie_done for t in ties_of.get((r, s), ()))

    def step_once(r) -> str:
        """'ok' (ran), 'wait' (blocked), or 'bad' (a precondition does not hold)."""
        ins = plan.ranks[r].instrs[ptr[r]]
        op, s, m, i = ins.op, ins.stage, ins.mb, ins.slice
        if s is not None and m is not None and (s, m) in freed:
            return "bad"
        if op is Op.LOAD:
            loaded.add((r, m))
        elif op is Op.FORWARD:
            if r in stepped or (i and ("f", s, m, i - 1) not in done):
                return "bad"
            if (s == 0 or s == k - 1) and (r, m) not in loaded:
                return "bad"
            if s > 0 and ("act", s, m, i) not in have:
                return "bad"
            done.add(("f", s, m, i))
            if s + 1 < k and rank_of[s + 1] == r:
                have.add(("act", s + 1, m, i))
        elif op is Op.RECOMPUTE:
            if ("f", s, m, i) not in done or r in stepped:
                return "bad"
            done.add(("r", s, m, i))
        elif op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            fwd = next(x for x in plan.ranks[r].instrs if x.op is Op.FORWARD and x.key == (s, m, i))
            if ("f", s, m, i) not in done or (fwd.checkpoint and ("r", s, m, i) not in done):
                return "bad"
            if i + 1 < nslices[m] and ("b", s, m, i + 1) not in done:
                return "bad"
            if s < k - 1 and ("grad", s, m, i) not in have:
                return "bad"
            if op is Op.BACKWARD and not weights_open(r, s) or r in stepped:
                return "bad"
            done.add(("b", s, m, i))
            if s > 0 and rank_of[s - 1] == r:
                have.add(("grad", s - 1, m, i))
        elif op is Op.BACKWARD_WEIGHT:
            if ("b", s, m, i) not in done or not weights_open(r, s):
                return "bad"
        elif op is Op.SEND:
            if ins.payload is Payload.ACT:
                if ("f", s, m, i) not in done:
                    return "bad"
                msg = ("act", s + 1, m, i)
            else:
                if ("b", s, m, i) not in done:
                    return "bad"
                msg = ("grad", s - 1, m, i)
            chan.setdefault((r, ins.peer), []).append(msg)
        elif op is Op.RECV:
            queue = chan.get((ins.peer, r), [])
            if not queue:
                return "wait"
            if queue[0] != (ins.payload.value, s, m, i):
                return "bad"  # the message at the head is another one: channels are FIFO
            have.add(queue.pop(0))
        elif op is Op.FREE_KV:
            freed.add((s, m))
        elif op is Op.ALLREDUCE:
            if r in stepped:
                return "bad"
            reduced.add(s)
        elif op is Op.REDUCE_TIED:
            if r in stepped:
                return "bad"
            arrived.setdefault(ins.tie, set()).add(r)
            if arrived[ins.tie] != tie_ranks[ins.tie]:
                return "wait"
            tie_done.add((r, ins.tie))
        elif op is Op.STEP:
            stepped.add(r)
        return "ok"

    progress = True
    while progress:
        progress = False
        for r, rp in enumerate(plan.ranks):
            while ptr[r] < len(rp.instrs):
                outcome = step_once(r)
                if outcome == "bad":
                    return False
                if outcome == "wait":
                    break
                ptr[r] += 1
                progress = True
    return all(ptr[r] == len(rp.instrs) for r, rp in enumerate(plan.ranks))


ORACLE_BASES = [
    build_plan(placement=(0, 1, 0), mbs=2, slices=((0, 3), (3, 8)), split=True, ties=(("emb", (0, 1)),)),
    build_plan(placement=(0, 1), mbs=2, slices=((0, 2), (2, 5), (5, 8)), checkpoint=True, data=2),
]


@pytest.mark.parametrize("plan", ORACLE_BASES, ids=["interleaved-split-tied", "checkpoint-dp2"])
def test_oracle_accepts_the_valid_base_plans(plan):
    assert verify(plan) == [] and runs_cleanly(plan)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(range(len(ORACLE_BASES))), data=st.data())
def test_verifier_agrees_with_execution_on_reordered_plans(base, data):
    """Move a few instructions a short way within their rank: the verifier finds no error
    exactly when the plan executes cleanly. The oracle's channels are buffered (a send never
    waits for its receive), so the verifier is asked under gloo's rules, which are the same;
    under NCCL's a send can also deadlock waiting for its receive to be posted."""
    plan = ORACLE_BASES[base]
    streams = [list(rp.instrs) for rp in plan.ranks]
    for _ in range(data.draw(st.integers(1, 3))):
        r = data.draw(st.integers(0, len(streams) - 1))
        src = data.draw(st.integers(0, len(streams[r]) - 1))
        dst = min(len(streams[r]) - 1, max(0, src + data.draw(st.integers(-4, 4))))
        streams[r].insert(dst, streams[r].pop(src))
    moved = dataclasses.replace(plan, ranks=tuple(
        dataclasses.replace(rp, instrs=tuple(s)) for rp, s in zip(plan.ranks, streams)))
    assert (verify(moved, GLOO) == []) == runs_cleanly(moved)


def test_cli_verify_prints_located_errors_and_exits_1(tmp_path, capsys):
    from tpc.cli.main import main

    good, bad = tmp_path / "good.tpir", tmp_path / "bad.tpir"
    good.write_text(EXAMPLE, encoding="utf-8")
    bad.write_text(delete(EXAMPLE, 25), encoding="utf-8")
    assert main(["verify", str(good)]) == 0
    assert "ok (2 ranks, 2 stages, 24 instructions)" in capsys.readouterr().out
    assert main(["verify", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:13:1: error: rank 0 never runs `step`" in err
    assert "   13 | rank 0" in err


def test_version_1_plans_stay_readable_and_print_as_version_1():
    """A plan written before format version 2 parses, verifies and prints back byte for byte."""
    from tpc.ir.verify import check

    text = (Path(__file__).parent / "golden" / "zero_bubble_three_ranks.tpir").read_text()
    assert "\ntpir 1\n" in "\n" + text
    plan = parse(text)
    assert plan.header.version == 1
    check(plan)
    assert print_plan(plan) == text


def test_require_version_refuses_an_addition_in_an_older_plan():
    """Rule H1: a line added in version 2 is an error in a `tpir 1` plan, and fine in `tpir 2`."""
    from dataclasses import replace

    from tpc.ir.verify.header import require_version
    from tpc.ir.verify.report import Report

    text = (Path(__file__).parent / "golden" / "zero_bubble_three_ranks.tpir").read_text()
    old = parse(text)
    rep = Report(old)
    assert not require_version(old, rep, 2, None, "rank 0, instruction 0", (1, 0), "`example`")
    (d,) = rep.sorted()
    assert d.message == "`example` needs format version 2, and this plan says `tpir 1`"
    assert "tpir 2" in d.hint
    new = replace(old, header=replace(old.header, version=2))
    rep2 = Report(new)
    assert require_version(new, rep2, 2, None, "rank 0, instruction 0", (1, 0), "`example`")
    assert not rep2.sorted()
