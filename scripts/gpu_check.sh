#!/usr/bin/env bash
# GPU check, one command on a GPU node (no network needed once installed):
#   bash scripts/gpu_check.sh [OUT_DIR]
#   WHEELHOUSE=/path/to/wheels PYTHON=/usr/bin/python3 bash scripts/gpu_check.sh   # offline install first
#
# 1. check-model: a mid-sized Qwen2.5-VL-shaped checkpoint (random weights, made here) through
#    transformers and through mimo-sft's megatron model on the GPU, fp32: logits must agree.
# 2. bf16 fine-tunes of a Qwen2.5-VL-3B-shaped model (the public 3B architecture, random init, no
#    download) with the distributed optimizer, on synthetic document data with mixed image sizes,
#    multi-image and text-only samples:
#      - colocated on every GPU (reordering does not apply to colocated layouts): megatron's local
#        attention, the SDPA core (default), and the SDPA core with --in-batch-packing;
#      - with >= 4 GPUs also non-colocated (language on half the GPUs, vision tower on the other
#        half), reordering off and on;
#    and of Qwen3.5-0.8B's architecture (hybrid Gated DeltaNet), colocated and packed.
#    Before them, fla's Gated DeltaNet kernels against mimo-sft's torch stand-ins (scripts/check_gdn_fla.py).
#    Each prints tokens/s, step time, model TFLOP/s per GPU, MFU and peak GPU memory per module.
# Knobs: GPU_CHECK_STEPS (20), GPU_CHECK_SEQ (2048), GPU_CHECK_MBS (4, at least the GPU count),
#        GPU_CHECK_GBS (4 micro-batches),
#        GPU_CHECK_PEAK_TFLOPS (default: looked up from the GPU name).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
STEPS=${GPU_CHECK_STEPS:-20}
SEQ=${GPU_CHECK_SEQ:-2048}
PY=${GPU_CHECK_PYTHON:-.venv/bin/python}
[ -n "${GPU_CHECK_PYTHON:-}" ] || make install >/dev/null
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 HF_HUB_DISABLE_PROGRESS_BARS=1
NGPU=$($PY - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch.cuda.is_available() is False; run this on a GPU machine")
print(torch.cuda.device_count())
PY
)
$PY -c "import torch; print('GPU:', torch.cuda.get_device_name(0), 'x', torch.cuda.device_count(), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"
MBS=${GPU_CHECK_MBS:-$(( NGPU > 4 ? NGPU : 4 ))}
GBS=${GPU_CHECK_GBS:-$(( 4 * MBS ))}
mkdir -p "$OUT"
PEAK=()
[ -z "${GPU_CHECK_PEAK_TFLOPS:-}" ] || PEAK=(--peak-tflops "$GPU_CHECK_PEAK_TFLOPS")

echo "== check-model (fp32, GPU): transformers vs mimo-sft on a mid-sized Qwen2.5-VL-shaped checkpoint"
[ -f "$OUT/mid/config.json" ] || $PY scripts/make_tiny_qwen_vl.py "$OUT/mid" --vision-hidden 256 --vision-depth 4 \
  --vision-heads 4 --text-hidden 1024 --text-layers 8 --heads 16 --kv-heads 4 --intermediate 2816 >/dev/null
$PY -m mimo_sft check-model --hf-model "$OUT/mid"

echo "== Qwen3.5 Gated DeltaNet kernels: fla vs mimo-sft's torch stand-ins (packed, forward and backward, bf16)"
$PY scripts/check_gdn_fla.py

echo "== model and data"
[ -f "$OUT/qwen2.5-vl-3b/config.json" ] || $PY scripts/make_tiny_qwen_vl.py "$OUT/qwen2.5-vl-3b" --preset qwen2.5-vl-3b --config-only
[ -d "$OUT/data" ] || $PY scripts/make_demo_data.py "$OUT/data" --samples 1024 --long-answers >/dev/null
TORCHRUN="$(dirname "$PY")/torchrun"
[ -x "$TORCHRUN" ] || TORCHRUN="$PY -m torch.distributed.run"

# --max-pixels 250880 (320 merged tokens) bounds the demo data's largest page (420 x 560) without resizing
# any image; the memory forecast (check 23) holds the run to it instead of Qwen's 12.8 Mpx default
run() {  # run NAME NPROC ARGS...
  local name=$1 nproc=$2
  shift 2
  echo "== $name ($nproc GPU(s))"
  rm -rf "$OUT/$name"
  $TORCHRUN --nproc-per-node "$nproc" -m mimo_sft finetune --hf-model "${RUN_MODEL:-$OUT/qwen2.5-vl-3b}" --allow-random-init \
    --dataset-path "$OUT/data" --dtype bf16 --use-distributed-optimizer --seq-length "$SEQ" \
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$STEPS" --lr 1e-5 --lr-warmup-iters 2 \
    --dataloader-type cyclic --log-interval 5 --no-tensorboard --output-dir "$OUT/$name" "${PEAK[@]}" \
    --max-pixels 250880 "$@" \
    2>&1 | grep --line-buffered -v -E "Warning|warnings.warn|^\s*$"
  local status=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] || { echo "gpu_check: $name failed (exit $status)" >&2; exit "$status"; }
  $PY scripts/summarize_run.py "$OUT/$name"
}

COLO=(--component "language=dp=$NGPU" --component "images=dp=$NGPU" --scalable-dp)
run colocated-local-attention "$NGPU" "${COLO[@]}" --attention-backend local --no-in-batch-packing
run colocated "$NGPU" "${COLO[@]}" --no-in-batch-packing
run colocated-packed "$NGPU" "${COLO[@]}" --in-batch-packing
if [ "$NGPU" -ge 4 ]; then
  HALF=$((NGPU / 2))
  NONCO=(--component "language=dp=$HALF" --component "images=dp=$HALF,rank_offset=$HALF" --scalable-dp)
  run noncolocated-reorder-off "$NGPU" "${NONCO[@]}"
  run noncolocated-reorder-on "$NGPU" "${NONCO[@]}" --intra-microbatch-reorder
fi
# Qwen3.5-0.8B's public architecture (hybrid Gated DeltaNet; fla's kernels when importable, else the stand-ins)
[ -f "$OUT/qwen3.5-0.8b/config.json" ] || $PY scripts/make_tiny_qwen_vl.py "$OUT/qwen3.5-0.8b" --preset qwen3.5-0.8b --config-only
RUN_MODEL="$OUT/qwen3.5-0.8b" run qwen3.5-0.8b-colocated-packed "$NGPU" "${COLO[@]}" --in-batch-packing
if [ "$NGPU" -lt 4 ]; then
  echo "== reordering: skipped (needs >= 4 GPUs: a non-colocated layout with a data-parallel vision tower;"
  echo "   NCCL cannot put two ranks on one GPU)"
fi
