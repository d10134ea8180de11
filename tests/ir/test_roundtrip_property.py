"""Properties of the parser and printer over generated plans and mutated text.

- text -> Plan -> text and Plan -> text -> Plan are identities (comments included) for random
  valid plans;
- any text, in particular a golden or generated plan with one line mutated, either parses (and
  then re-prints to a fixpoint) or raises TpirError whose diagnostics all point inside the file;
  never another exception.
"""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ir.plans import random_plan, simple_plan, trivia
from tpc.ir.diagnostics import TpirError
from tpc.ir.parse import SYNTAX, parse
from tpc.ir.printer import print_plan
from tpc.ir.verify import verify

GOLDEN_TEXTS = [p.read_text() for p in sorted((Path(__file__).parent / "golden").glob("*.tpir"))]

FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------ round trips


@FAST
@given(random_plan())
def test_plan_text_plan(plan):
    text = print_plan(plan)
    back = parse(text, file="gen.tpir")
    assert back == plan
    assert trivia(back) == trivia(plan)
    assert print_plan(back) == text


@FAST
@given(random_plan(comments=False))
def test_generated_plans_are_valid(plan):
    assert verify(plan) == []


def test_simple_plan_options_are_valid_and_round_trip():
    plans = [
        simple_plan(1, 1, 1),
        simple_plan(2, 2, [3, 5], data=2, mb_size=2),
        simple_plan(2, 2, [[2, 6], [8]], stages=3, tie=True, checkpoint=True),
        simple_plan(3, 1, 3, stages=4, split_backward=True, tie=True),
    ]
    for plan in plans:
        assert verify(plan) == []
        assert parse(print_plan(plan)) == plan
    assert plans[2].header.stages_of_rank(0) == (0, 1)
    assert plans[2].header.microbatches[1].slices == ((0, 8),)


# ------------------------------------------------------------------------------- bad input


def _check_outcome(text: str) -> None:
    """Parses (and then re-prints to a fixpoint), or raises TpirError located inside the file."""
    n_lines = text.count("\n") + 1
    try:
        plan = parse(text, file="m.tpir")
    except TpirError as e:
        assert e.diagnostics
        for d in e.diagnostics:
            assert d.loc is not None and d.loc.file == "m.tpir", d
            assert 1 <= d.loc.line <= n_lines, (d, n_lines)
            assert d.loc.col >= 1, d
            assert d.message and d.hint, d
        assert e.render()
        return
    canonical = print_plan(plan)
    again = parse(canonical)
    assert again == plan
    assert print_plan(again) == canonical


@st.composite
def base_text(draw) -> str:
    if draw(st.booleans()):
        return draw(st.sampled_from(GOLDEN_TEXTS))
    return print_plan(draw(random_plan(max_pipe=2, max_mbs=2, max_slices=2)))


_NUMBER = re.compile(r"-?\d+")
_BOUND = re.compile(r"\d+(?=:)|(?<=:)\d+")
_PEER = re.compile(r"(?<=to )\d+|(?<=from )\d+")
garbage = st.one_of(
    st.text(max_size=8),
    st.sampled_from(sorted(SYNTAX) + ['"', "\\", ":", "#", "-", "\n", "\t", "tpir 1", "0:"]),
)


def _replace_match(draw, text: str, pattern: re.Pattern) -> str:
    matches = list(pattern.finditer(text))
    if not matches:
        return text
    m = draw(st.sampled_from(matches))
    value = draw(st.integers(-3, 70))
    return text[: m.start()] + str(value) + text[m.end():]


@st.composite
def mutated(draw) -> str:
    text = draw(base_text())
    lines = text.split("\n")
    kind = draw(st.sampled_from(["swap", "delete", "bound", "peer", "number", "garbage"]))
    if kind == "swap":
        i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines)
    if kind == "delete":
        del lines[draw(st.integers(0, len(lines) - 1))]
        return "\n".join(lines)
    if kind == "bound":
        return _replace_match(draw, text, _BOUND)
    if kind == "peer":
        return _replace_match(draw, text, _PEER)
    if kind == "number":
        return _replace_match(draw, text, _NUMBER)
    at = draw(st.integers(0, len(text)))
    return text[:at] + draw(garbage) + text[at:]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_text_parses_or_fails_located(text):
    _check_outcome(text)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_random_text_parses_or_fails_located(text):
    _check_outcome(text)


_SOUP = st.lists(
    st.one_of(
        st.sampled_from(sorted(SYNTAX) + ["act", "grad", "to", "from", "mb", "slice", "stage",
                                          "checkpoint", "pipe", "data", "batch", "seq", "vocab",
                                          "dtype", "size", "slices", "units", "stages", "sha256",
                                          "factory", "1", "0", "-1", "0:4", '"x"', '"a\\"b"',
                                          "float32", "\n", "\n", "\n", "# c\n"]),
        st.integers(-2, 5).map(str),
    ),
    max_size=40,
).map(" ".join)


@settings(max_examples=150, deadline=None)
@given(_SOUP)
def test_keyword_soup_parses_or_fails_located(text):
    _check_outcome("tpir 1\n" + text)
