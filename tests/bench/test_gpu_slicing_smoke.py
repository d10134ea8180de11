"""bench/gpu_slicing.py in its CPU smoke mode: every part runs (compile, stage timings, the
interpreter, the profiler) and the tables it prints hold what they claim."""

from __future__ import annotations

import re

import pytest
import torch

from tests.bench.scripts import loaded
from tests.conftest import ROOT

SMOKE = ["--device", "cpu", "--model", "tiny", "--seq-len", "128", "--repeats", "1"]


@pytest.fixture
def gpu_slicing(monkeypatch):
    """The script as a module (`scripts.loaded`); run from the repository root."""
    monkeypatch.chdir(ROOT)
    yield from loaded(monkeypatch, "gpu_slicing.py")


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table of `text`: (header cells, rows of cells)."""
    found, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            found.append((block[0], block[2:]))  # block[1] is the |---| line
            block = []
    return found


def number(cell: str) -> float:
    return float(cell.rstrip("%"))


def test_smoke_run_prints_three_filled_tables(gpu_slicing, capsys):
    status = gpu_slicing.main(SMOKE)
    out = capsys.readouterr().out
    assert status == 0
    (h1, overhead), (h2, steps), (h3, attention) = tables(out)

    # 1. slicing overhead: one row per stage of the 4-stage plan, then the total
    assert h1 == ["stage", "1 slice ms", "8 slices ms (sum)", "8 slices / 1 slice"]
    assert [r[0].split(" (")[0] for r in overhead] == ["stage 0", "stage 1", "stage 2", "stage 3", "all stages"]
    for _, one, eight, ratio in overhead:
        assert number(one) > 0 and number(eight) > 0
        assert number(ratio) == pytest.approx(number(eight) / number(one), rel=0.05, abs=0.01)
    # 8 slices of 16 tokens of a width-64 model: the per-slice fixed costs dominate
    assert number(overhead[-1][3]) > 1.0

    # 2. the interpreter: both plans trained, the same first loss, positive FLOP/s
    assert h2[:5] == ["plan", "step ms", "loss (step 1)", "TFLOP / step", "achieved TFLOP/s"]
    assert [r[0] for r in steps] == ["4 stages x 1 slice", "4 stages x 8 slices"]
    for _, ms, loss, tflop, achieved, peak, share in steps:
        assert number(ms) > 0 and number(tflop) > 0 and number(achieved) > 0
        assert (peak, share) == ("-", "-")  # no device preset describes a CPU
    assert number(steps[0][2]) == pytest.approx(number(steps[1][2]), abs=1e-3)
    assert number(steps[0][2]) == pytest.approx(torch.log(torch.tensor(512.0)).item(), rel=0.05)
    ratio = re.search(r"sliced / unsliced step time: ([0-9.]+)", out)
    assert ratio and float(ratio.group(1)) > 0

    # 3. attention: the first slice has no prefix, the last one the 7 slices before it
    assert h3 == ["slice", "SDPA path", "flash", "attention ops", "GPU attention kernels"]
    assert [r[0] for r in attention] == ["slice 0: tokens 0:16, no prefix", "slice 7: tokens 112:128, prefix of 112"]
    for _, path, flash, ops, kernels in attention:
        assert path in ("flash", "efficient", "cuDNN", "math", "math (softmax + bmm)")
        assert flash == ("yes" if path == "flash" else "no")
        assert "scaled_dot_product" in ops or path.startswith("math")
        assert kernels == "-"  # no CUDA activity on a CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_missing_is_one_line_error(gpu_slicing, capsys):
    assert gpu_slicing.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device cpu" in err


def test_timed_steps_size_kv_as_the_engine_and_copy_no_gradients(gpu_slicing, monkeypatch, capsys):
    """Every forward the bench times gets the KV capacity the engine passes (the whole
    sequence: no buffer doubling the engine never does), and the interpreter's timed steps keep
    no copy of the gradients."""
    from tpc.executors import engine
    from tpc.executors.stage_runtime import StageRuntime

    capacities, copies = [], []
    forward = StageRuntime.forward

    def recording(self, mb, sl, x, offset, targets=None, checkpoint=False, capacity=None):
        capacities.append(capacity)
        return forward(self, mb, sl, x, offset, targets, checkpoint, capacity)

    step = engine.RankEngine._step

    def step_recording(self, instr):
        copies.append(self.options.keeps_grads)
        return step(self, instr)

    monkeypatch.setattr(StageRuntime, "forward", recording)
    monkeypatch.setattr(engine.RankEngine, "_step", step_recording)
    assert gpu_slicing.main(SMOKE) == 0
    capsys.readouterr()
    assert capacities and set(capacities) == {128}
    assert copies and not any(copies)
