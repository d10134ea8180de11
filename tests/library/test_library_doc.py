"""docs/library.md shows the whole difference between nanoGPT's train.py and its pipelined
copy, as the files have it; its example script runs."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_show_the_whole_nanogpt_diff():
    folder = ROOT / "examples" / "nanogpt_train"
    a = (folder / "train.py").read_text().splitlines()
    b = (folder / "train_tpc.py").read_text().splitlines()
    diff = list(difflib.unified_diff(a, b, "train.py", "train_tpc.py", n=1, lineterm=""))
    shown = re.search(r"```diff\n(.*?)\n```", (ROOT / "docs" / "library.md").read_text(), re.S).group(1)
    assert shown.splitlines() == diff
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    assert added <= 20  # the aim: a loop pipelined in at most 20 changed lines


def test_the_example_script_runs_and_learns(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "library_loop.py"), "--interpret", "--steps", "12"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+), grad norm", done.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], done.stdout
    assert "evaluation loss" in done.stdout
