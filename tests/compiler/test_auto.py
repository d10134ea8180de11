"""The plan search behind --slices/--schedule/--stages auto and --memory-per-rank, against
brute force on the tiny GPT (4 units: embedding, two blocks, head).

Most tests use a synthetic profile (known unit costs, nothing timed) and call the search on a
model traced once; one module-scoped CPU profile of the real model (`tpc profile`) checks the
same properties on measured costs, and a few tests go through `tpc compile` end to end.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tpc.cli.compile import check_options, parse_memory
from tpc.compiler.compile import compile_plan
from tpc.compiler.header import header_maker, microbatch_sizes
from tpc.compiler.pipeline import search_space
from tpc.compiler.frontend import read_vocab
from tpc.compiler.costmodel.resolve import load_cost_source
from tpc.compiler.costmodel.store import save_profile
from tpc.compiler.lowering.lower import lower
from tpc.compiler.optimise.slice_optimiser import DEFAULT_GRANULARITY
from tpc.compiler.schedules import build_schedule, replicas, stages_per_rank
from tpc.compiler.predict.quantities import format_bytes
from tpc.compiler.optimise.search import AUTO_SCHEDULES, search_plan

# the tiny model ties its head to its embedding: every schedule is searched, chimera included
# (its tie reduced over both replicas of both tied stages: tests/executors/test_chimera_ties.py)
TIED_SEARCHED = AUTO_SCHEDULES
from tpc.compiler.predict.simulate import simulate
from tpc.compiler.optimise.slicing import equal_slices
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Microbatch, ScheduleLine
from tests.compiler.costmodel import synthetic

TINY = str(Path(__file__).parent / "models" / "tiny_gpt.py")
L = 64
BASE = dict(stages="2", microbatches=2, seq_len=L, batch=4, slices="auto", schedule="seq1f1b", dp=1,
            ranks=None)


@pytest.fixture(scope="module")
def tiny():
    """The tiny GPT traced once for every search of this module."""
    from tpc.compiler.frontend import SlicedModel, file_sha256, load_model

    model = load_model(TINY, "model")
    vocab = read_vocab(model, TINY)
    return SimpleNamespace(sliced=SlicedModel.from_model(model, seq_len=L, vocab=vocab),
                           vocab=vocab, sha=file_sha256(TINY))


def _source(path, tiny):
    return load_cost_source(cost=str(path), num_units=tiny.sliced.num_units, model_sha256=tiny.sha)


@pytest.fixture(scope="module")
def synthetic_path(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("costs") / "synthetic.msgpack"
    save_profile(synthetic.tiny_gpt_profile(tiny.sha), path)
    return path


@pytest.fixture(scope="module")
def measured_path(tiny, tmp_path_factory):
    """A real CPU profile of the tiny GPT (a few seconds)."""
    from tpc.executors.profile import profile_model

    path = tmp_path_factory.mktemp("costs") / "measured.msgpack"
    save_profile(profile_model(TINY, L, [1, 2]), path)
    return path


@pytest.fixture(scope="module", params=["synthetic", "measured"])
def source(request, tiny):
    return _source(request.getfixturevalue(f"{request.param}_path"), tiny)


def search(tiny, source, budget=None, **change):
    opts = check_options(**{**BASE, **change}, device_model="h100", memory_per_rank=budget)
    make = header_maker(model_path=TINY, sha256=tiny.sha, factory="model", opts=opts,
                        vocab=tiny.vocab, sliced=tiny.sliced)
    return search_plan(source, search_space(opts, tiny.sliced.num_units), make)


def simulated(header, source, comm="nccl"):
    """(step time, largest peak memory per rank) of a header, built and simulated here under the
    rules the search prices (the compile's --comm: NCCL's by default)."""
    plan = lower(header, build_schedule(header.schedule.name, header), verify=False, comm=comm)
    result = simulate(plan, source.for_stages([s.units for s in header.stages]), comm)
    return result.iteration_time, max(r.peak_memory.total for r in result.ranks)


# --------------------------------------------------------------------------- slicing


@pytest.mark.parametrize("schedule", ["terapipe", "seq1f1b"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_chosen_plan_is_never_slower_than_equal_slicing(tiny, source, schedule, microbatches):
    """The chosen plan, simulated, against n equal slices of equal micro-batches on the same
    partition and schedule, for every n that cuts L into whole slices of at least the DP's
    granularity."""
    result = search(tiny, source, schedule=schedule, microbatches=microbatches)
    chosen = result.best.header
    t_chosen, _ = simulated(chosen, source)
    assert t_chosen == pytest.approx(result.best.time, rel=1e-12)
    sizes = microbatch_sizes(4, microbatches)
    equal = {}
    for n in range(1, L + 1):
        if L % n or L // n < DEFAULT_GRANULARITY:
            continue
        cuts = equal_slices(n, L)
        mbs = tuple(Microbatch(index=m, size=b, slices=cuts) for m, b in enumerate(sizes))
        equal[n], _ = simulated(dataclasses.replace(chosen, microbatches=mbs), source)
    assert sorted(equal) == [1, 2, 4, 8]
    assert t_chosen <= min(equal.values()) * (1 + 1e-12), (t_chosen, equal)


def test_pruning_bound_is_a_lower_bound(tiny, source):
    """busy_bound never exceeds a simulated time, so a candidate it rules out is slower than
    the chosen plan."""
    from tpc.compiler.schedules import stages_per_rank
    from tpc.compiler.optimise.search import busy_bound

    result = search(tiny, source, stages="auto", ranks=4, microbatches=1, schedule="auto")
    assert {"zbv", "1f1b"} <= {c.schedule for c in result.candidates}
    for c in result.candidates:
        bound = busy_bound(source.for_stages(c.ranges), c.slicing, c.data, stages_per_rank(c.schedule))
        if c.simulated:
            assert 0 < bound <= c.time * (1 + 1e-12)
        else:
            assert bound == c.time > result.best.time and c.header is None and not c.fits


def test_cost_partition_follows_the_unit_times(tiny, tmp_path):
    """A head that costs as much as everything else gets a stage of its own; the parameter
    balance puts it with a block."""
    path = tmp_path / "heavy-head.msgpack"
    save_profile(synthetic.tiny_gpt_profile(tiny.sha, head_scale=6.0), path)
    plan = compile_plan(TINY, check_options(**{**BASE, "slices": "4"}, cost=str(path), quiet=True))
    assert [s.units for s in plan.header.stages] == [(0, 3), (3, 4)]
    assert tiny.sliced.partition_by_params(2) != [(0, 3), (3, 4)]
    plain = compile_plan(TINY, check_options(**{**BASE, "slices": "4"}, quiet=True))
    assert [s.units for s in plain.header.stages] == [tuple(r) for r in tiny.sliced.partition_by_params(2)]


# -------------------------------------------------------------------------- schedules


def _fixed_slices_search(tiny, source, budget=None, comm="nccl"):
    """Four micro-batches of eight given slices: the schedules differ most in memory here."""
    return search(tiny, source, budget, schedule="auto", microbatches=4, slices="8", comm=comm)


@pytest.mark.parametrize("which_budget", ["none", "between"])
def test_schedule_auto_is_the_fastest_schedule_that_fits(tiny, source, which_budget):
    """Brute force: every schedule the search compares (AUTO_SCHEDULES) built on the chosen
    partition and simulated here; the search's choice is the fastest of those within the budget.
    A V-shaped schedule runs twice the stages on the same ranks, on a partition of its own, and
    chimera two replicas of each stage (its tie reduced over both): their headers are the
    search's candidates of them, built and simulated here again."""
    free = _fixed_slices_search(tiny, source)
    peaks = sorted({c.peak for c in free.candidates if c.simulated})
    budget = None if which_budget == "none" else (peaks[0] + peaks[1]) / 2
    result = _fixed_slices_search(tiny, source, budget)
    brute = {}
    assert any(c.schedule == "chimera" for c in free.candidates)
    own_placement = {n for n in TIED_SEARCHED if stages_per_rank(n) == 2 or replicas(n) == 2}
    for name in sorted(TIED_SEARCHED):
        if name in own_placement or result.best.schedule in own_placement:
            # the schedule's own candidate header (or, when the choice is such a schedule, every
            # schedule's: the chosen header is not a plain one to put another schedule on)
            c = next(c for c in free.candidates if c.schedule == name)
            opts = check_options(**{**BASE, "schedule": "auto", "microbatches": 4, "slices": "8"},
                                 device_model="h100")
            make = header_maker(model_path=TINY, sha256=tiny.sha, factory="model", opts=opts,
                                vocab=tiny.vocab, sliced=tiny.sliced)
            h = make(c.pipe, c.data, c.ranges, name, c.slicing.microbatches())
            if stages_per_rank(name) == 2:
                assert h.num_stages == 2 * h.mesh.pipe == 2 * result.best.header.mesh.pipe
        else:
            h = dataclasses.replace(result.best.header, schedule=ScheduleLine(name=name))
        t, peak = simulated(h, source)
        if budget is None or peak <= budget:
            brute[name] = t
    assert result.best.schedule in brute
    assert result.best.time == pytest.approx(min(brute.values()), rel=1e-12)
    assert brute[result.best.schedule] == pytest.approx(min(brute.values()), rel=1e-12)
    if budget is not None:
        assert result.best.peak <= budget and len(brute) < len(TIED_SEARCHED)


def test_schedule_auto_with_slices_auto_matches_each_schedule_searched_alone(tiny, source):
    """With --schedule auto, --stages K fixes the pipeline ranks: a V-shaped schedule runs 2K
    stages on them, which alone is --schedule zbv --stages 2K."""
    auto = search(tiny, source, schedule="auto", microbatches=4)
    alone = {name: search(tiny, source, schedule=name, microbatches=4,
                          stages=str(2 * stages_per_rank(name))).best.time for name in TIED_SEARCHED}
    assert auto.best.time == pytest.approx(min(alone.values()), rel=1e-12)
    assert alone[auto.best.schedule] == pytest.approx(auto.best.time, rel=1e-12)


def test_equally_fast_schedules_go_to_the_smaller_one(tiny, synthetic_path):
    """With these costs and gloo's buffered sends 1f1b, terapipe and gpipe take the same
    simulated time; 1f1b holds fewer slice activations, so it wins among them. The zero-bubble
    schedules are faster (their deferred weight gradients fill the bubble), zb-h1 and zb-h2
    equally so here; zb-h1 holds less, so it wins among the schedules of one weight replica.
    Chimera with forward doubling is faster still (its pairs of forwards cost a backward, and
    the two pipelines fill each other's bubbles) at more activation memory: it wins the search.
    (Under NCCL's rules, the default, terapipe's and gpipe's late receives expose their
    transfers: see the next test.)"""
    from tpc.compiler.optimise.search import _fastest

    free = _fixed_slices_search(tiny, _source(synthetic_path, tiny), comm="gloo")
    by_name = {c.schedule: c for c in free.candidates}
    assert by_name["terapipe"].time == pytest.approx(by_name["1f1b"].time, rel=1e-9)
    assert by_name["1f1b"].peak < by_name["terapipe"].peak
    assert _fastest([c for c in free.candidates if c.schedule in ("terapipe", "seq1f1b", "1f1b", "gpipe")]).schedule == "1f1b"
    assert by_name["zb-h1"].time == pytest.approx(by_name["zb-h2"].time, rel=1e-9)
    assert by_name["zb-h1"].time < by_name["1f1b"].time
    assert by_name["zb-h1"].peak < by_name["zb-h2"].peak
    assert _fastest([c for c in free.candidates if c.fits and replicas(c.schedule) == 1]).schedule == "zb-h1"
    assert by_name["chimera-doubling"].time < by_name["zb-h1"].time < by_name["chimera"].time
    assert by_name["chimera-doubling"].peak > by_name["chimera"].peak > by_name["zb-h1"].peak
    assert free.best.schedule == "chimera-doubling"


def test_under_nccl_rules_the_search_prices_exposed_transfers(tiny, synthetic_path):
    """The search prices the backend the plan is for (`--comm`, NCCL by default): there a
    message moves only once its receive has started, so a schedule whose receives come late
    (terapipe: every forward, then every backward) pays transfers that 1F1B's exchanges hide,
    and nothing is faster than under gloo's buffered sends."""
    source = _source(synthetic_path, tiny)
    nccl = {c.schedule: c for c in _fixed_slices_search(tiny, source).candidates if c.simulated}
    gloo = {c.schedule: c for c in _fixed_slices_search(tiny, source, comm="gloo").candidates if c.simulated}
    assert set(nccl) == set(gloo)
    for name in nccl:
        assert nccl[name].time >= gloo[name].time * (1 - 1e-12), name
    assert nccl["terapipe"].time > nccl["1f1b"].time
    assert gloo["terapipe"].time == pytest.approx(gloo["1f1b"].time, rel=1e-9)


def test_tight_memory_forces_seq1f1b(tiny, synthetic_path):
    """A budget below every other schedule's peak forces seq1f1b (slices of four micro-batches
    interleaved with their backwards), slower but the smallest."""
    source = _source(synthetic_path, tiny)
    free = _fixed_slices_search(tiny, source)
    assert free.best.schedule != "seq1f1b"
    seq = next(c for c in free.candidates if c.schedule == "seq1f1b")
    others = sorted(c.peak for c in free.candidates if c.schedule != "seq1f1b")
    assert seq.peak < others[0] and seq.time > free.best.time
    tight = _fixed_slices_search(tiny, source, budget=(seq.peak + others[0]) / 2)
    assert tight.best.schedule == "seq1f1b" and tight.best.time == seq.time
    assert [c.fits for c in tight.candidates] == [c.schedule == "seq1f1b" for c in tight.candidates]


def test_nothing_fits_names_the_smallest_peak(tiny, synthetic_path):
    source = _source(synthetic_path, tiny)
    free = _fixed_slices_search(tiny, source)
    smallest = min(c.peak for c in free.candidates)
    with pytest.raises(TpirError) as e:
        _fixed_slices_search(tiny, source, budget=smallest * 0.99)
    text = e.value.render()
    assert f"the smallest peak is {format_bytes(smallest)} per rank" in text
    assert "seq1f1b" in text and f"allow at least {format_bytes(smallest)}" in text


# ----------------------------------------------------------------------------- meshes


def test_stages_auto_over_four_ranks_matches_brute_force(tiny, source):
    """Every pipe x data split of 4 ranks searched on its own; --stages auto picks the fastest."""
    auto = search(tiny, source, stages="auto", ranks=4, microbatches=1, schedule="auto")
    assert {(c.pipe, c.data) for c in auto.candidates} == {(1, 4), (2, 2), (4, 1)}
    alone = {}
    for pipe in (1, 2, 4):
        r = search(tiny, source, stages=str(pipe), dp=4 // pipe, microbatches=1, schedule="auto")
        alone[pipe, 4 // pipe] = r.best.time
    assert auto.best.time == pytest.approx(min(alone.values()), rel=1e-12)
    assert alone[auto.best.pipe, auto.best.data] == pytest.approx(auto.best.time, rel=1e-12)
    h = auto.best.header
    assert (h.mesh.pipe, h.mesh.data) == (auto.best.pipe, auto.best.data)
    assert len(h.stages) == h.mesh.pipe and h.shape.batch == 4


def test_meshes_that_cannot_hold_the_batch_are_left_out(tiny, synthetic_path):
    result = search(tiny, _source(synthetic_path, tiny), stages="auto", ranks=4, microbatches=2)
    assert {(c.pipe, c.data) for c in result.candidates} == {(2, 2), (4, 1)}
    assert result.space.skipped == ("1x4: 1 sequence(s) per replica, fewer than 2 micro-batches",)


def test_compile_stages_auto_end_to_end_trains_like_autograd(tmp_path, synthetic_path, capsys):
    """`tpc compile --stages auto --ranks 4 --schedule auto --explain` writes a plan the
    interpreter runs with plain autograd's gradients, and explains the choice."""
    from tpc.cli.main import main

    out = tmp_path / "plan.tpir"
    argv = ["compile", TINY, "-o", str(out), "--stages", "auto", "--ranks", "4", "--microbatches", "2",
            "--seq-len", "32", "--batch", "4", "--slices", "auto", "--schedule", "auto",
            "--cost", str(synthetic_path), "--memory-per-rank", "1GiB", "--explain"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "plan search: " in err and "memory budget 1.00 GiB per rank" in err
    header = next(line for line in err.splitlines() if "units/stage" in line).split()
    assert header == ["mesh", "units/stage", "schedule", "slicing", "step", "(sim)", "peak/rank", "fits"]
    for text in ("2x2", "4x1", "terapipe", "seq1f1b", "1f1b", "gpipe", "zb-h1", "zb-h2", "seq-zb", "dp: mb", "equal 4: mb",
                 "not searched: 1x4", "chosen: ", "why: the fastest simulated step of",
                 "optimiser: "):
        assert text in err, text
    rows = [line for line in err.splitlines() if re.match(r"^ +\*? +\d+x\d+ ", line)]
    assert len(rows) >= 16 and sum(row.lstrip().startswith("*") for row in rows) == 1
    assert all(row.rstrip().endswith(("yes", "pruned")) for row in rows)
    assert main(["run", "--interpret", str(out), "--verify-grads", "-q"]) == 0
    assert "tolerance 1e-05: ok" in capsys.readouterr().out


def test_explain_marks_candidates_over_budget(tmp_path, synthetic_path, capsys):
    compile_plan(TINY, check_options(**{**BASE, "microbatches": 4, "slices": "8", "schedule": "auto"},
                 cost=str(synthetic_path), memory_per_rank="300KiB", explain=True))  # fmt: skip
    err = capsys.readouterr().err
    fits = {}
    for line in err.splitlines():
        if re.match(r"^ +\*? +\d+x\d+ ", line):
            cells = line.split()
            cells = cells[1:] if cells[0] == "*" else cells
            fits[cells[2]] = cells[-1]
    assert fits["terapipe"] == "NO" and "yes" in fits.values() and len(fits) == len(TIED_SEARCHED)
    assert "memory budget 300.00 KiB per rank" in err


# ---------------------------------------------------------------------------- options


@pytest.mark.parametrize("text, value", [("16GiB", 16 * 2**30), ("512 MiB", 512 * 2**20),
                                         ("1.5GB", 1.5e9), ("4096", 4096), ("2kib", 2048)])
def test_memory_sizes(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("text", ["lots", "16 GiBs", "-1GiB", "0", ""])
def test_bad_memory_sizes_are_refused_before_tracing(text, tmp_path):
    with pytest.raises(TpirError) as e:
        compile_plan(str(tmp_path / "missing.py"), check_options(**BASE, device_model="h100", memory_per_rank=text))
    assert "is not a memory size" in e.value.render() and "e.g. 16GiB" in e.value.render()


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(stages="auto", ranks=4), "--stages auto compares pipeline depths"),
        (dict(schedule="auto"), "--schedule auto compares schedules"),
    ],
)
def test_auto_without_a_cost_model_is_refused(change, words):
    with pytest.raises(TpirError) as e:
        check_options(**{**BASE, **change})
    assert words in e.value.render() and "--device-model" in e.value.render()


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(stages="auto"), "--stages auto needs the number of ranks"),
        (dict(stages="auto", ranks=4, dp=2), "--dp 2 with --stages auto"),
    ],
)
def test_stages_auto_option_mistakes(change, words):
    with pytest.raises(TpirError) as e:
        check_options(**{**BASE, **change}, device_model="h100")
    assert words in e.value.render() and "hint:" in e.value.render()


def test_no_mesh_of_the_ranks_fits(synthetic_path):
    with pytest.raises(TpirError) as e:
        compile_plan(TINY, check_options(**{**BASE, "stages": "auto", "ranks": 8, "batch": 3, "microbatches": 1},
                     cost=str(synthetic_path), quiet=True))  # fmt: skip
    text = e.value.render()
    assert "no pipeline x data split of --ranks 8 fits" in text
    assert "8x1: 8 stages but the model has 4 units" in text and "4x2: a batch of 3" in text


# ----------------------------------------------------------------- --microbatches auto


def test_microbatches_auto_takes_the_knapsacks_sizes(tiny, source):
    """With --microbatches auto the optimiser's batch knapsack chooses how many micro-batches
    and of what size, for the partition the search settled on; the equal slicings it is
    compared with use the same micro-batches."""
    from tpc.compiler.optimise.slice_optimiser import optimise

    result = search(tiny, source, microbatches="auto")
    dp = [c for c in result.candidates if c.slicing.origin == "dp"]
    assert dp
    choice = optimise(source.for_stages(dp[0].ranges), 2, L, 4, microbatches=None)
    assert dp[0].slicing.mb_sizes == choice.mb_sizes and sum(choice.mb_sizes) == 4
    for c in result.candidates:
        assert c.slicing.mb_sizes == choice.mb_sizes, c.slicing.summary()
    best = result.best.header
    assert tuple(m.size for m in best.microbatches) == choice.mb_sizes


def test_microbatches_auto_compiles_and_trains_like_autograd(tmp_path, synthetic_path, capsys):
    from tpc.cli.main import main

    out = tmp_path / "plan.tpir"
    assert main(["compile", TINY, "-o", str(out), "--stages", "2", "--microbatches", "auto",
                 "--seq-len", "32", "--batch", "4", "--slices", "auto", "--cost", str(synthetic_path),
                 "-q"]) == 0
    assert main(["run", "--interpret", str(out), "--verify-grads", "-q"]) == 0
    assert "tolerance 1e-05: ok" in capsys.readouterr().out


@pytest.mark.parametrize("change, costs", [(dict(microbatches="auto"), False),
                                           (dict(microbatches="auto", slices="4"), True)])
def test_microbatches_auto_needs_the_optimiser(change, costs):
    with pytest.raises(TpirError) as e:
        check_options(**{**BASE, **change}, device_model="h100" if costs else None)
    text = e.value.render()
    assert "--microbatches auto lets the optimiser" in text and "--slices auto" in text


@pytest.mark.parametrize("spec", ["two", "0", "-1"])
def test_bad_microbatch_counts_are_refused(spec):
    with pytest.raises(TpirError) as e:
        check_options(**{**BASE, "microbatches": spec}, device_model="h100")
    assert "--microbatches" in e.value.render() and "hint:" in e.value.render()


def test_chimera_is_searched_for_an_untied_model(tmp_path, capsys):
    """An untied GPT: `--schedule auto` simulates chimera among the others, and chimera alone
    is as fast as the search's chimera candidate."""
    from pathlib import Path

    untied = str(Path(__file__).resolve().parents[2] / "bench" / "models" / "gpt_untied.py")
    opts = dict(stages="4", microbatches=4, seq_len=64, batch=8, slices="1", device_model="h100")
    compile_plan(untied, check_options(**opts, schedule="auto", explain=True))
    rows = [line.split() for line in capsys.readouterr().err.splitlines() if re.match(r"^ +\*? +\d+x\d+ ", line)]
    assert any("chimera" in row for row in rows)
