import io
import json
import math

from tpc.executors.training.progress import MetricsWriter, Progress, format_eta, format_rate


def test_plain_lines_every_n_steps_first_and_last():
    out = io.StringIO()
    p = Progress(10, stream=out, every=4)
    for step in range(1, 11):
        p.update(step, loss=2.0 / step, tokens=1000, step_time=0.5)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/10", "4/10", "8/10", "10/10"]
    assert lines[1] == "step  4/10  loss 0.5000  2.0k tok/s  0.500 s/step  ETA 0:00:03"
    assert lines[-1].endswith("ETA 0:00:00")
    assert "\r" not in out.getvalue()


def test_tty_redraws_one_line_in_place_and_ends_it():
    out = io.StringIO()
    p = Progress(4, stream=out, tty=True)
    p.update(1, loss=10.0, tokens=2_000_000, step_time=1.0, lr=3e-4, grad_norm=1.5)
    p.message("saved checkpoint step_000001")
    for step in (2, 3, 4):
        p.update(step, loss=1.25, tokens=500, step_time=2.0)
    text = out.getvalue()
    draws = [d.rstrip() for d in text.replace("\n", "\r").split("\r") if d.strip()]
    first = next(d for d in draws if "1/4" in d)
    assert first.endswith("1/4, loss 10.0000  lr 3.00e-04  |g| 1.500  2.0M tok/s  1.000 s/step  ETA 0:00:03")
    # the message has a line of its own; the bar is redrawn below it, in place (no newline)
    assert "saved checkpoint step_000001\n" in text
    assert draws[-1].endswith("| 4/4, loss 1.2500  250 tok/s  2.000 s/step  ETA 0:00:00")
    assert draws[-1].startswith("100%|####################|")
    assert text.endswith("\n") and text.count("\n") == 2  # the message and the closed bar


def test_quiet_and_other_ranks_print_nothing():
    for kw in (dict(quiet=True), dict(rank=1)):
        out = io.StringIO()
        p = Progress(3, stream=out, tty=True, **kw)
        for step in (1, 2, 3):
            p.update(step, loss=1.0, tokens=1, step_time=1.0)
        p.message("hello")
        assert out.getvalue() == ""


def test_eta_uses_recent_steps():
    p = Progress(30, quiet=True)
    for step in range(1, 21):
        p.update(step, loss=1.0, tokens=1, step_time=100.0 if step <= 10 else 1.0)
    assert p.eta(20) == 10.0  # the slow first ten steps have left the window
    assert format_eta(3725) == "1:02:05" and format_eta(math.nan) == "?"
    assert format_rate(999) == "999" and format_rate(51234) == "51.2k"


def test_metrics_jsonl(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.write(1, loss=5.5, lr=3e-5, grad_norm=1.25, tokens_per_s=5120.0, step_time=0.2)
        w.write(2, loss=float("nan"), lr=6e-5, grad_norm=None, tokens_per_s=5000.0, step_time=0.25, tokens=1024)
    lines = path.read_text().splitlines()
    assert lines[0] == '{"step": 1, "loss": 5.5, "lr": 3e-05, "grad_norm": 1.25, "tokens_per_s": 5120.0, "step_time": 0.2}'
    assert json.loads(lines[1]) == {"step": 2, "loss": None, "lr": 6e-5, "grad_norm": None, "tokens_per_s": 5000.0,
                                    "step_time": 0.25, "tokens": 1024}
    with MetricsWriter(path, append=True) as w:
        w.write(3, loss=1.0, lr=1e-4, grad_norm=0.5, tokens_per_s=1.0, step_time=1.0)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    with MetricsWriter(path) as w:
        pass
    assert path.read_text() == ""


def test_resumed_metrics_drop_rows_after_the_checkpoint(tmp_path):
    """A run that crashed after step 5 with its last checkpoint at step 3 resumes at 3: rows 4
    and 5 (and a half-written line) give way to the rerun's, so each step appears once."""
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        for step in range(1, 6):
            w.write(step, loss=float(step), lr=0.1, grad_norm=None, tokens_per_s=1.0, step_time=1.0)
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # the crash cut a line short
    with MetricsWriter(path, append=True, keep_through=3) as w:
        w.write(4, loss=40.0, lr=0.1, grad_norm=None, tokens_per_s=1.0, step_time=1.0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
