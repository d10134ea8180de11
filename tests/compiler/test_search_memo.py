"""The search's cost-model memo: every question the simulator asks per instruction is answered
once per distinct argument tuple, with the model's own answer, and a question the model cannot
answer stays unanswerable (the simulator then uses its fallback)."""

from __future__ import annotations

from collections import Counter

import pytest

from tpc.compiler.optimise.search import _Memo


class Counting:
    """A cost model that counts how often each question reaches it."""

    num_stages = 2

    def __init__(self):
        self.calls = Counter()

    def _ask(self, name, *args):
        self.calls[name] += 1
        return (name, args)

    def slice_time(self, stage, l, c, mb):
        return self._ask("slice_time", stage, l, c, mb)

    def split_backward_time(self, stage, l, c, mb):
        return self._ask("split_backward_time", stage, l, c, mb)

    def p2p_time(self, nbytes):
        return self._ask("p2p_time", nbytes)

    def activation_bytes(self, l, mb):
        return self._ask("activation_bytes", l, mb)

    def kv_bytes(self, stage, l, mb):
        return self._ask("kv_bytes", stage, l, mb)

    def param_bytes(self, stage):
        return self._ask("param_bytes", stage)

    def stash_bytes(self, stage, l, c, mb):
        return self._ask("stash_bytes", stage, l, c, mb)

    def grad_sync_time(self, stage, data):
        return self._ask("grad_sync_time", stage, data)

    def describe(self):
        return self._ask("describe")


QUESTIONS = {
    "slice_time": [(0, 8, 0, 1), (1, 8, 16, 2)],
    "split_backward_time": [(0, 8, 0, 1), (1, 8, 16, 2)],
    "p2p_time": [(4096,), (8192,)],
    "activation_bytes": [(8, 1), (16, 2)],
    "kv_bytes": [(0, 8, 1), (1, 16, 2)],
    "param_bytes": [(0,), (1,)],
    "stash_bytes": [(0, 8, 0, 1), (1, 8, 16, 2)],
    "grad_sync_time": [(0, 2), (1, 2)],
}


@pytest.mark.parametrize("name", sorted(QUESTIONS))
def test_each_question_reaches_the_model_once_per_arguments(name):
    inner = Counting()
    memo = _Memo(inner)
    for _ in range(3):
        for args in QUESTIONS[name]:
            assert getattr(memo, name)(*args) == (name, args)
    assert inner.calls[name] == len(QUESTIONS[name])


def test_what_is_not_memoised_is_the_models_own():
    inner = Counting()
    memo = _Memo(inner)
    memo.describe(), memo.describe()
    assert inner.calls["describe"] == 2
    assert memo.num_stages == 2


def test_a_question_the_model_cannot_answer_stays_unanswerable():
    class NoSplit:  # a model that prices only whole backwards
        num_stages = 1

        def slice_time(self, stage, l, c, mb):
            return (1.0, 2.0)

    memo = _Memo(NoSplit())
    assert getattr(memo, "split_backward_time", None) is None
    assert memo.slice_time(0, 8, 0, 1) == (1.0, 2.0)
