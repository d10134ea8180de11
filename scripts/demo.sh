#!/usr/bin/env bash
# The main job, on a fresh machine: set up, make a corpus, compile examples/gpt.py into a 2-stage
# token-sliced plan, draw its predicted timeline, train it under torchrun on CPU (2 ranks, gloo),
# and sample text from the trained checkpoint. Everything it writes goes to out/ (override: OUT=dir).
# Knobs: STEPS (default 300), SEQ (128), BATCH (8).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
STEPS=${STEPS:-300}
SEQ=${SEQ:-128}
BATCH=${BATCH:-8}
mkdir -p "$OUT"

bash scripts/setup.sh
export OMP_NUM_THREADS=1

echo "== corpus: byte tokens of the Python standard library's sources"
[ -f "$OUT/data/train.bin" ] || python3 examples/prepare_corpus.py -o "$OUT/data" --max-bytes 4000000

echo "== compile: 2 pipeline stages, 2 micro-batches, token slices chosen by the optimiser"
tpc compile examples/gpt.py -o "$OUT/plan.tpir" --stages 2 --microbatches 2 \
    --seq-len "$SEQ" --batch "$BATCH" --slices auto --schedule seq1f1b
tpc verify "$OUT/plan.tpir"

echo "== simulate: predicted timeline"
tpc simulate "$OUT/plan.tpir" --unit --png "$OUT/timeline.png" --trace "$OUT/timeline.json"

echo "== train: $STEPS steps, 2 ranks under torchrun (gloo on CPU)"
torchrun --nproc-per-node 2 --no-python --log-dir "$OUT/torchrun-logs" --redirects 0 \
    tpc run "$OUT/plan.tpir" --steps "$STEPS" --data "$OUT/data/train.bin" \
    --lr 2e-3 --warmup 20 --grad-clip 1.0 --metrics "$OUT/metrics.jsonl" \
    --checkpoint-dir "$OUT/ckpt" --save-every 100

echo "== sample from the trained model"
tpc sample "$OUT/ckpt" --prompt "def " --tokens 200 --seed 0

cat <<MSG

Done. Where things went:
  plan              $OUT/plan.tpir        (read it; \`tpc show $OUT/plan.tpir\`)
  timeline picture  $OUT/timeline.png     (trace for Perfetto: $OUT/timeline.json)
  metrics           $OUT/metrics.jsonl
  checkpoint        $OUT/ckpt/            (\`tpc export $OUT/ckpt -o model.pt\`)
MSG
