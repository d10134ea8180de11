"""What a training run shows and records per step: a progress line on rank 0, and a JSONL file.

On a terminal, a tqdm bar redrawn in place, the run's figures after it:

    40%|########            | 40/100, loss 2.3141  lr 3.00e-04  51.2k tok/s  0.160 s/step  ETA 0:00:09

Into a file or pipe (a CI log, `| tee`), in-place redraws would be noise, so plain lines are
written every `every` steps and at the last one:

    step 40/100  loss 2.3141  lr 3.00e-04  51.2k tok/s  0.160 s/step  ETA 0:00:09

With `tpc run --eval-data`, a step that was evaluated adds its validation loss and perplexity
(`val 2.1032 ppl 8.19`), and its plain line is written whatever `every` says.

The ETA is the remaining steps times the mean time of the last few steps (the first steps of a
run are slower: allocation, warm caches, so a run-long mean would overestimate). The bar is
tqdm's (what PyTorch users see from most training loops): it keeps the line the width of the
terminal and lets a message (a checkpoint saved) print above it.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import deque
from typing import IO, Any

from tqdm import tqdm

from tpc.ir.files import atomic_write_text, write_error

_RECENT = 10


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def format_rate(tokens_per_s: float) -> str:
    """Tokens per second with a k/M suffix: 51234 -> '51.2k'."""
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.1f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


def perplexity(loss: float) -> float:
    """exp(loss): the perplexity of a mean token loss (inf where it would overflow)."""
    return math.exp(loss) if loss < 700 else math.inf


def format_validation(val_loss: float) -> str:
    """'val 2.1032 ppl 8.19': a validation loss and its perplexity."""
    return f"val {val_loss:.4f} ppl {perplexity(val_loss):.2f}"


def format_stats(*, loss: float, tokens_per_s: float, step_time: float, eta: float, lr: float | None = None,
                 grad_norm: float | None = None, val_loss: float | None = None) -> str:
    parts = [f"loss {loss:.4f}"]
    if val_loss is not None:
        parts.append(format_validation(val_loss))
    if lr is not None:
        parts.append(f"lr {lr:.2e}")
    if grad_norm is not None:
        parts.append(f"|g| {grad_norm:.3f}")
    parts += [f"{format_rate(tokens_per_s)} tok/s", f"{step_time:.3f} s/step", f"ETA {format_eta(eta)}"]
    return "  ".join(parts)


class Progress:
    """`update(...)` after each step. Prints only on rank 0 and when not quiet.

    `step` counts completed steps from 1 and may start above 1 in a resumed run; `total_steps`
    is the step the run ends at. `every` (plain-line mode) defaults to about 20 lines a run.
    """

    def __init__(self, total_steps: int, quiet: bool = False, stream: IO[str] | None = None, *, rank: int = 0,
                 every: int | None = None, tty: bool | None = None):
        self.total = total_steps
        self.stream = stream if stream is not None else sys.stdout
        self.enabled = not quiet and rank == 0
        self.tty = _isatty(self.stream) if tty is None else tty
        self.every = every if every is not None else max(1, total_steps // 20)
        self._recent: deque[float] = deque(maxlen=_RECENT)
        self._bar: tqdm | None = None

    def eta(self, step: int) -> float:
        if not self._recent:
            return math.nan
        return (self.total - step) * sum(self._recent) / len(self._recent)

    def update(self, step: int, *, loss: float, tokens: int, step_time: float, lr: float | None = None,
               grad_norm: float | None = None, val_loss: float | None = None) -> None:
        self._recent.append(step_time)
        if not self.enabled:
            return
        stats = format_stats(loss=loss, tokens_per_s=tokens / step_time if step_time > 0 else math.inf,
                             step_time=step_time, eta=self.eta(step), lr=lr, grad_norm=grad_norm,
                             val_loss=val_loss)
        if self.tty:
            bar = self._open(step - 1)
            bar.set_postfix_str(stats, refresh=False)
            bar.update(step - bar.n)
            if step >= self.total:
                self.close()
        elif step % self.every == 0 or step >= self.total or step == 1 or val_loss is not None:
            width = len(str(self.total))
            self.stream.write(f"step {step:>{width}}/{self.total}  {stats}\n")
            self.stream.flush()

    def _open(self, done: int) -> tqdm:
        if self._bar is None:
            # every redraw shows the newest figures (mininterval 0); the figures are ours
            self._bar = tqdm(total=self.total, initial=done, file=self.stream, mininterval=0,
                             dynamic_ncols=True, bar_format="{l_bar}{bar:20}| {n_fmt}/{total_fmt}{postfix}")
        return self._bar

    def message(self, text: str) -> None:
        """A line of its own (e.g. "saved checkpoint ..."), above the bar on a terminal."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar so later output starts on a fresh line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class MetricsWriter:
    """One JSON object per line per step, flushed at once (a crashed run keeps what it logged):

        {"step": 1, "loss": 5.54, "lr": 3e-05, "grad_norm": 1.2, "tokens_per_s": 5120.0, "step_time": 0.2}

    Keys in that order, then any extras in the order given. A non-finite number (a diverged
    loss) is written as null, since JSON has no NaN. `append=True` continues an existing file
    (a resumed run); otherwise the file is started afresh. With `keep_through=S`, an appending
    writer first drops the rows of steps after S (logged by a run that crashed after its last
    checkpoint, and about to be run again), so each step appears once.
    """

    def __init__(self, path: str | os.PathLike, *, append: bool = False, keep_through: int | None = None):
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        try:
            if parent:
                os.makedirs(parent, exist_ok=True)
            if append and keep_through is not None and os.path.isfile(self.path):
                _truncate_after(self.path, keep_through)
            self._f = open(self.path, "a" if append else "w", encoding="utf-8")
        except OSError as e:
            raise write_error(self.path, e) from None

    def _line(self, record: dict) -> None:
        try:
            self._f.write(json.dumps({k: _finite(v) for k, v in record.items()}) + "\n")
            self._f.flush()
        except OSError as e:  # a full disk: said in words, naming the file
            raise write_error(self.path, e) from None

    def write(self, step: int, *, loss: float, lr: float, grad_norm: float | None, tokens_per_s: float,
              step_time: float, **extra: Any) -> None:
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                  "step_time": step_time, **extra}
        self._line(record)

    def write_eval(self, step: int, *, val_loss: float, val_ppl: float) -> None:
        """A row of an evaluation alone (before the first step: {"step": 0, "val_loss": ...})."""
        record = {"step": step, "val_loss": val_loss, "val_ppl": val_ppl}
        self._line(record)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _truncate_after(path: str, step: int) -> None:
    """Keep the rows of steps <= `step` (and any line that is not a row, e.g. half a line a crash
    left, is dropped too: it would not parse). Rewritten all or nothing (tpc.ir.files)."""
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    atomic_write_text(path, "".join(kept))
