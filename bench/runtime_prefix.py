"""The stage runtime of a revision (default: the one before the KV-buffer change) against the
current one, side by side in one process: forward + backward of the whole bench/models/gpt_untied.py
`long` model (4 x 256) on one sequence of L=1024 tokens cut into n equal slices, one thread,
alternating A/B, median of 5.

    OMP_NUM_THREADS=1 python bench/runtime_prefix.py [--rev REV]
"""
import argparse
import subprocess
import tempfile
import importlib.util
import statistics
import sys
import time
from pathlib import Path
import torch
torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--rev", default="28b906a", help="revision whose runtime is the baseline")
ap.add_argument("--slices", default="1,4,8,16,32,64")
opts = ap.parse_args()
old_src = subprocess.run(["git", "show", f"{opts.rev}:executors/stage_runtime.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
old_path = Path(tempfile.mkdtemp()) / "old_stage_runtime.py"
old_path.write_text(old_src)
from tpc.compiler.frontend import SlicedModel, load_model
from tpc.executors.stage_runtime import StageRuntime as New
spec = importlib.util.spec_from_file_location("old_rt", old_path)
old = importlib.util.module_from_spec(spec); sys.modules["old_rt"] = old; spec.loader.exec_module(old)
Old = old.StageRuntime

L = 1024
torch.manual_seed(0)
model = load_model(str(ROOT / "bench/models/gpt_untied.py"), "long")
sm = SlicedModel.from_model(model, seq_len=L, vocab=256)
stage = sm.stage_module(0, sm.num_units)
tokens = torch.randint(0, 256, (1, L + 1))
ids, tg = tokens[:, :-1], tokens[:, 1:]

def step(cls, n):
    rt = cls(stage, 1.0 / L)
    cuts = [(L * i // n, L * (i + 1) // n) for i in range(n)]
    t0 = time.perf_counter()
    for i, (a, b) in enumerate(cuts):
        rt.forward(0, i, ids[:, a:b], a, tg[:, a:b])
    for i in reversed(range(n)):
        rt.backward(0, i)
    rt.free_kv(0)
    return time.perf_counter() - t0

for n in map(int, opts.slices.split(",")):
    step(Old, n); step(New, n)
    o, w = [], []
    for _ in range(5):  # alternate A/B
        o.append(step(Old, n)); w.append(step(New, n))
    mo, mw = statistics.median(o) * 1e3, statistics.median(w) * 1e3
    print(f"slices {n:>2}: before {mo:7.1f} ms  after {mw:7.1f} ms  after/before {mw/mo:.3f}")
