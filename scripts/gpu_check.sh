#!/usr/bin/env bash
# GPU check: mimo-sft on one GPU with no network, in the time a lent GPU machine gives (docs/install.md, "GPU check").
#
#   bash scripts/gpu_check.sh [OUT]              on the GPU machine (default OUT: runs/gpu-check)
#   bash scripts/gpu_check.sh --rehearse [OUT]   the same stages on this CPU at tiny sizes (a suite test runs it)
#
# Before a GPU loan, on a machine with the package index: bash scripts/fetch_gpu_wheels.sh (fills the ignored
# .whl/ and .whl-fla/, about 21 MB), then carry .whl and .whl-fla with the working tree.
#
# Install path, never the network: the wheels the machine lacks (scripts/gpu_wheels.txt) go in with
#   python -m pip install --no-index --no-deps --target SITE .whl/*.whl
# and every step runs with PYTHONPATH=SITE:<repo>, so the machine's CUDA torch, torchvision and triton stay.
# The rehearsal runs that same pip command on wheels rebuilt from the distributions `make install` put in
# .venv (scripts/wheels_from_env.py): a clean clone needs no network beyond what `make install` used.
#
# Stages, most important first, each with its own limit inside one budget (GPU_CHECK_BUDGET, default 480 s;
# 540 s in the rehearsal): every family packed on one GPU; one profiled step's kernels (the first family's run);
# transformers' model on the same rows; Qwen3.5 with fla against the torch path; peak memory against the
# forecast at micro-batch 2 and 8; check-model. Each records ok, failed (its last error line), timed out or
# skipped (scripts/gpu_check.py).
# Exits 0 when every stage is ok, 1 otherwise. GPU_CHECK_STAGES=hf,memory runs only those (install and inputs
# always run; the rest are recorded as skipped).
# Back in OUT, 4 files: log.txt (everything, unfiltered), summary.json, kernels.txt, runs.tgz.
# Settings: GPU_CHECK_PYTHON (default python3; .venv/bin/python with --rehearse), GPU_CHECK_WHEELS (.whl; "none"
# on a node whose interpreter already has every package, e.g. GPU_CHECK_PYTHON=.venv/bin/python after make install),
# GPU_CHECK_FLA_WHEELS (.whl-fla), GPU_CHECK_WORK (scratch, default a new temporary folder, removed after).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=gpu
out=""
for arg in "$@"; do
  case "$arg" in
    --rehearse) mode=rehearse ;;
    -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done
if [ $mode = rehearse ]; then
  py=${GPU_CHECK_PYTHON:-.venv/bin/python}; out=${out:-runs/gpu-check-rehearsal}
else
  py=${GPU_CHECK_PYTHON:-python3}; out=${out:-runs/gpu-check}
fi
command -v "$py" >/dev/null || { echo "gpu_check: no interpreter $py (set GPU_CHECK_PYTHON)" >&2; exit 2; }
mkdir -p "$out"
if [ -n "$(ls -A "$out")" ]; then
  echo "gpu_check: $out is not empty; give an empty or new folder for the results" >&2
  exit 2
fi
args=(--mode "$mode" --out "$out" --python "$py" --whl "${GPU_CHECK_WHEELS:-.whl}"
      --fla "${GPU_CHECK_FLA_WHEELS:-.whl-fla}")
[ -z "${GPU_CHECK_BUDGET:-}" ] || args+=(--budget "$GPU_CHECK_BUDGET")
[ -z "${GPU_CHECK_STAGES:-}" ] || args+=(--stages "$GPU_CHECK_STAGES")
[ -z "${GPU_CHECK_WORK:-}" ] || args+=(--work "$GPU_CHECK_WORK")
[ $mode = rehearse ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/log.txt"
"$py" -u scripts/gpu_check.py "${args[@]}" 2>&1 | tee -a "$out/log.txt"
exit "${PIPESTATUS[0]}"
