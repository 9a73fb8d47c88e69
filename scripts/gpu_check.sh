#!/usr/bin/env bash
# GPU check (one GPU): a single-process colocated fine-tune in bf16 over NCCL, on a locally made
# Qwen2.5-VL-shaped checkpoint (no download), printing step time and tokens/s.
#   bash scripts/gpu_check.sh [OUT_DIR]
# Prints the run summary; figures go to docs/benchmarks.md ("GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
make install >/dev/null
PY=.venv/bin/python
$PY - <<'PY'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch.cuda.is_available() is False; run this on a GPU machine")
print("GPU:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
mkdir -p "$OUT"
# a mid-sized model so the GPU has work: vision hidden 256 x 4 blocks, text hidden 1024 x 8 layers
[ -f "$OUT/model/config.json" ] || $PY scripts/make_tiny_qwen_vl.py "$OUT/model" --vision-hidden 256 --vision-depth 4 \
  --vision-heads 4 --text-hidden 1024 --text-layers 8 --heads 16 --kv-heads 4 --intermediate 2816 >/dev/null
[ -d "$OUT/data" ] || $PY scripts/make_demo_data.py "$OUT/data" --samples 512 >/dev/null
rm -rf "$OUT/run"
.venv/bin/torchrun --nproc-per-node 1 -m mimo_sft finetune --component language=dp=1 --component images=dp=1 \
  --hf-model "$OUT/model" --dataset-path "$OUT/data" --dtype bf16 --seq-length 1024 --micro-batch-size 8 \
  --global-batch-size 32 --train-iters 20 --lr 1e-4 --lr-warmup-iters 2 --output-dir "$OUT/run" --no-tensorboard
$PY scripts/summarize_run.py "$OUT/run"
