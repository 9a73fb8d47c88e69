#!/usr/bin/env bash
# `make demo`: a tiny Qwen2.5-VL checkpoint and a synthetic document dataset, then a real
# 4-process CPU fine-tune (language on ranks 0-1, vision tower on ranks 2-3, scalable DP,
# intra-microbatch reordering with overlap), then a summary of what happened; then a colocated run
# (both modules on the same 2 processes) whose per-GPU balancing takes its cost weights from the
# phases the first run measured (--reorder-calibrate-from).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${DEMO_DIR:-demo}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 HF_HUB_DISABLE_PROGRESS_BARS=1
[ -f "$OUT/tiny-qwen2.5-vl/config.json" ] || $PY scripts/make_tiny_qwen_vl.py "$OUT/tiny-qwen2.5-vl" --seed 0 >/dev/null
[ -d "$OUT/data" ] || $PY scripts/make_demo_data.py "$OUT/data" --samples 400 --seed 0 >/dev/null
echo "== validate (dry run, no processes)"
$PY -m mimo_sft validate --quiet --config configs/demo.yaml --hf-model "$OUT/tiny-qwen2.5-vl" --dataset-path "$OUT/data"
echo
echo "== plan: what reordering does to this data on this layout"
$PY -m mimo_sft plan --config configs/demo.yaml --hf-model "$OUT/tiny-qwen2.5-vl" --dataset-path "$OUT/data" --steps 30 --out "$OUT/plan"
echo
echo "== finetune: mimo-sft finetune --nproc-per-node 4 --config configs/demo.yaml ..."
rm -rf "$OUT/run"
# The filter only hides library warnings; the fine-tune's own exit status decides the demo's.
set +e
.venv/bin/mimo-sft finetune --nproc-per-node 4 \
  --config configs/demo.yaml --hf-model "$OUT/tiny-qwen2.5-vl" --dataset-path "$OUT/data" \
  --output-dir "$OUT/run" --export-hf "$OUT/run/hf-export" 2>&1 | grep --line-buffered -v -E "Warning|warnings.warn|^\s*$|W1[0-9]{3} |\*{10}|OMP_NUM_THREADS|^  [a-z_ ]+ = |^  (class |super\(|return |model = )|^WARNING:"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  echo "demo: the fine-tune failed (exit status $status); see the error above" >&2
  exit "$status"
fi
echo
$PY scripts/summarize_run.py "$OUT/run"
echo
echo "== finetune, colocated: language dp 2 and images dp 2 on the same 2 processes, each one's whole step"
echo "   balanced (cost weights calibrated from the run above), single images moved to the lighter tower"
rm -rf "$OUT/run-colocated"
set +e
.venv/bin/mimo-sft finetune --nproc-per-node 2 \
  --config configs/demo.yaml --hf-model "$OUT/tiny-qwen2.5-vl" --dataset-path "$OUT/data" \
  --component "language=dp=2" --component "images=dp=2" --reorder-calibrate-from "$OUT/run" --encoder-balance \
  --train-iters 10 --log-interval 5 --output-dir "$OUT/run-colocated" 2>&1 | grep --line-buffered -v -E "Warning|warnings.warn|^\s*$|W1[0-9]{3} |\*{10}|OMP_NUM_THREADS|^  [a-z_ ]+ = |^  (class |super\(|return |model = )|^WARNING:"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  echo "demo: the colocated fine-tune failed (exit status $status); see the error above" >&2
  exit "$status"
fi
