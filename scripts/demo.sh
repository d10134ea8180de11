#!/usr/bin/env bash
# The main job, on a fresh machine: set up, make a corpus, measure this machine's compute costs,
# compile examples/gpt.py into a 2-stage token-sliced plan (the optimiser picks the slices from
# the measured costs), draw its predicted timeline, train it under torchrun on CPU (2 ranks,
# gloo), and sample text from the trained checkpoint. Everything it writes goes to out/
# (override: OUT=dir). Training prints the validation loss (the plan's forward-only evaluation
# program on 4 batches of val.bin) before the first and after the last step. Knobs: STEPS (default 500), SEQ (128), BATCH (16), LR (3e-3).
# About 3 minutes on 2 CPU cores. Run it again with RESUME=1 STEPS=1000 to continue training
# from the last checkpoint (STEPS is the step training ends at).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
STEPS=${STEPS:-500}
SEQ=${SEQ:-128}
BATCH=${BATCH:-16}
LR=${LR:-3e-3}
RESUME=${RESUME:-0}
export OMP_NUM_THREADS=1 PIP_ROOT_USER_ACTION=ignore PYTHONWARNINGS=ignore
mkdir -p "$OUT"

section() { printf '\n== %s\n' "$*"; }
started=$SECONDS

section "setup"
bash scripts/setup.sh

section "corpus: byte tokens of the Python standard library's sources"
if [ -f "$OUT/data/train.bin" ]; then echo "reusing $OUT/data/"
else python3 examples/prepare_corpus.py -o "$OUT/data" --max-bytes 4000000; fi

section "profile: forward and backward times of the model's units on this machine"
# an earlier run's profile is reused only while it is valid for this model file, this machine
# and this tpc's profile format (a newer tpc measures more and refuses an older file)
if [ -f "$OUT/profile.msgpack" ] && python3 - "$OUT/profile.msgpack" <<'PY' 2>/dev/null
import sys
from tpc.compiler.costmodel.store import load_profile
from tpc.compiler.frontend import file_sha256
from tpc.executors.profile import device_name
load_profile(sys.argv[1], model_sha256=file_sha256("examples/gpt.py"), device=device_name("cpu"))
PY
then echo "reusing $OUT/profile.msgpack"
else tpc profile examples/gpt.py -o "$OUT/profile.msgpack" --seq-len "$SEQ" --device cpu --batch-sizes "$((BATCH / 2))"; fi

section "compile: 2 pipeline stages, 2 micro-batches, token slices chosen by the optimiser"
tpc compile examples/gpt.py -o "$OUT/plan.tpir" --stages 2 --microbatches 2 \
    --seq-len "$SEQ" --batch "$BATCH" --slices auto --cost "$OUT/profile.msgpack" --schedule seq1f1b
tpc verify "$OUT/plan.tpir"
sed -n '/^eval/q;/^microbatch/p' "$OUT/plan.tpir"  # the training program's (the evaluation's follow `eval`)

section "simulate: predicted timeline"
tpc simulate "$OUT/plan.tpir" --cost "$OUT/profile.msgpack" --png "$OUT/timeline.png" --trace "$OUT/timeline.json"

section "train: to step $STEPS, 2 ranks under torchrun (gloo on CPU)"
resume=()
[ "$RESUME" = 1 ] && resume=(--resume)
torchrun --nproc-per-node 2 --no-python --log-dir "$OUT/torchrun-logs" --redirects 0 \
    tpc run "$OUT/plan.tpir" --steps "$STEPS" --data "$OUT/data/train.bin" --device cpu \
    --lr "$LR" --warmup 20 --grad-clip 1.0 --metrics "$OUT/metrics.jsonl" \
    --checkpoint-dir "$OUT/ckpt" --save-every 100 --eval-data "$OUT/data/val.bin" --eval-batches 4 \
    "${resume[@]}"
python3 - "$OUT/metrics.jsonl" <<'PY'
import json, sys
every = [json.loads(line) for line in open(sys.argv[1])]
rows = [r for r in every if "loss" in r]
mean = lambda rs: sum(r["loss"] for r in rs) / len(rs)
n = max(1, min(20, len(rows) // 4))
print(f"loss: {mean(rows[:n]):.3f} (mean of steps {rows[0]['step']}-{rows[n - 1]['step']}) -> "
      f"{mean(rows[-n:]):.3f} (steps {rows[-n]['step']}-{rows[-1]['step']}); "
      f"uniform over 256 bytes would be 5.545")
val = [r for r in every if "val_loss" in r]
if val:
    print(f"validation loss: {val[0]['val_loss']:.3f} after step {val[0]['step']} -> "
          f"{val[-1]['val_loss']:.3f} after step {val[-1]['step']} (perplexity "
          f"{val[0]['val_ppl']:.1f} -> {val[-1]['val_ppl']:.1f})")
PY

section "sample from the trained model (prompt \"def \")"
tpc sample "$OUT/ckpt" --prompt "def " --tokens 300 --temperature 0.7 --top-k 20 --seed 0

cat <<MSG

== done in $((SECONDS - started)) s. Where things went:
  plan              $OUT/plan.tpir        (read it; \`tpc show $OUT/plan.tpir\`)
  timeline picture  $OUT/timeline.png     (trace for Perfetto: $OUT/timeline.json)
  metrics           $OUT/metrics.jsonl    (one JSON line per step)
  checkpoint        $OUT/ckpt/$(cat "$OUT/ckpt/latest" 2>/dev/null)
                    (\`tpc export $OUT/ckpt -o model.pt\`; continue: RESUME=1 STEPS=$((2 * STEPS)) bash scripts/demo.sh)
MSG
