"""The evaluation program (format version 2): read, printed and verified as docs/ir.md says.
The golden file tests/ir/golden/eval_forward_only_dp2.tpir round-trips byte for byte with the
other golden files (test_parse_print.py); here: what the verifier refuses in it (rules E1-E4,
H1) and that each refusal is located and says what would be right."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Instr, Op
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.verify import verify

GOLDEN = (Path(__file__).parent / "golden" / "eval_forward_only_dp2.tpir").read_text(encoding="utf-8")
EVAL_AT = GOLDEN.index("\n# forward only")  # where the evaluation program starts


def _eval_edit(old: str, new: str) -> str:
    """The golden plan with one edit in its evaluation program."""
    head, tail = GOLDEN[:EVAL_AT], GOLDEN[EVAL_AT:]
    assert old in tail
    return head + tail.replace(old, new, 1)


def _errors(text: str) -> list:
    return verify(parse(text, file="e.tpir"))


def _line_of(text: str, needle: str, after: int = EVAL_AT) -> int:
    return text[:text.index(needle, after)].count("\n") + 1


def test_golden_evaluation_is_valid_and_forward_only():
    plan = parse(GOLDEN, file="g.tpir")
    assert verify(plan) == []
    view = plan.evaluation()
    assert view.forward_only and view.header.microbatches == plan.eval.microbatches
    assert view.header.stages == plan.header.stages and view.header.mesh == plan.header.mesh
    ops = {i.op for r in view.ranks for i in r.instrs}
    assert ops <= {Op.LOAD, Op.FORWARD, Op.SEND, Op.RECV, Op.FREE_KV, Op.REDUCE_LOSS}
    assert parse(print_plan(plan)) == plan
    assert plan.eval.comments == ("forward only: the loss of one batch, summed over the replicas on the last stage",)


def test_version_1_plan_may_not_hold_it():
    (d,) = _errors(GOLDEN.replace("tpir 2", "tpir 1", 1))
    assert "needs format version 2" in d.message and "`tpir 1`" in d.message
    assert d.loc.line == _line_of(GOLDEN, "eval  #") and "write `tpir 2`" in d.hint


def test_version_1_plan_without_it_still_reads():
    text = GOLDEN[:EVAL_AT].replace("tpir 2", "tpir 1", 1)
    plan = parse(text)
    assert plan.eval is None and verify(plan) == [] and print_plan(plan) == text


@pytest.mark.parametrize("old,new,expect,hint", [
    ("  forward stage 1 mb 0 slice 1\n", "  forward stage 1 mb 0 slice 1\n  backward stage 1 mb 0 slice 1\n",
     "runs forward only: no `backward`", "remove this line"),
    ("  free-kv stage 1 mb 0\n", "  send grad stage 1 mb 0 slice 0 to 0\n  free-kv stage 1 mb 0\n",
     "no `send grad`", "no gradient message"),
    ("  reduce-loss\n", "  reduce-loss\n  step\n", "no `step`", "no step"),
    ("forward stage 0 mb 0 slice 1\n", "forward stage 0 mb 0 slice 1 checkpoint\n", "`checkpoint` means nothing",
     "drop `checkpoint`"),
    ("  free-kv stage 0 mb 0\n", "  free-kv stage 0 mb 0\n  reduce-loss\n", "does not hold the last stage",
     "move this line to the evaluation's rank 1"),
])
def test_only_forward_instructions(old, new, expect, hint):
    text = _eval_edit(old, new)
    errors = _errors(text)
    assert any(expect in d.message and hint in d.hint for d in errors), errors
    assert all(d.loc is not None and d.loc.line > text[:EVAL_AT].count("\n") for d in errors)


def test_every_cache_freed_and_the_loss_reduced():
    errors = _errors(_eval_edit("  free-kv stage 1 mb 0\n  reduce-loss\n", ""))
    messages = sorted(d.message for d in errors)
    assert messages == ["the KV cache of stage 1 mb 0 is never freed",
                        "the evaluation loss is never summed over the 2 data-parallel replicas"]


def test_reduce_loss_after_the_last_forward():
    text = _eval_edit("  forward stage 1 mb 0 slice 1\n  free-kv stage 1 mb 0\n  reduce-loss\n",
                      "  reduce-loss\n  forward stage 1 mb 0 slice 1\n  free-kv stage 1 mb 0\n")
    (d,) = _errors(text)
    assert "reduce-loss runs before it is done with the loss of the last stage" in d.message
    assert d.loc.line == _line_of(text, "reduce-loss")


def test_reduce_loss_never_in_training():
    text = GOLDEN[:EVAL_AT].replace("  step\n", "  reduce-loss\n  step\n", 1)
    errors = _errors(text)
    assert any("reduce-loss belongs to the evaluation program" in d.message for d in errors)


def test_messages_in_order_and_matched():
    crossed = _eval_edit("  recv act stage 1 mb 0 slice 0 from 0\n  forward stage 1 mb 0 slice 0\n"
                         "  recv act stage 1 mb 0 slice 1 from 0\n",
                         "  recv act stage 1 mb 0 slice 1 from 0\n  recv act stage 1 mb 0 slice 0 from 0\n"
                         "  forward stage 1 mb 0 slice 0\n")
    assert any("messages from rank 0 cross" in d.message for d in _errors(crossed))
    unmatched = _eval_edit("  send act stage 0 mb 0 slice 1 to 1\n", "")
    assert any("rank 0 never sends this message" in d.message for d in _errors(unmatched))


def test_micro_batches_and_sections_of_the_evaluation():
    errors = _errors(_eval_edit("microbatch 0 size 2 slices 0:8 8:16", "microbatch 0 size 2 slices 0:8 9:16"))
    assert any("tokens 8:9 are in no slice" in d.message for d in errors)
    with pytest.raises(TpirError) as info:
        parse(_eval_edit("microbatch 0 size 2 slices 0:8 8:16\n", ""), file="e.tpir")
    assert "the evaluation program has no micro-batches" in info.value.diagnostics[0].message


def test_a_plan_without_lines_names_the_evaluation():
    plan = parse(GOLDEN)
    ev = plan.eval
    instrs = tuple(i.with_trivia(loc=None) for i in ev.ranks[1].instrs if i.op is not Op.REDUCE_LOSS)
    ranks = (ev.ranks[0], dataclasses.replace(ev.ranks[1], instrs=instrs, loc=None))
    bare = dataclasses.replace(plan, eval=dataclasses.replace(ev, ranks=ranks))
    (d,) = verify(bare)
    assert d.loc is None and d.where == "eval rank 1"
    assert Instr(Op.REDUCE_LOSS) not in instrs
