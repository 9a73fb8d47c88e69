#!/usr/bin/env bash
# Create .venv and install mimo-sft with its dependencies. Idempotent: a stamp file records the
# hash of what was installed, so a second run installs nothing.
#
# Order matters (see docs/install notes in README):
#   1. torch: keep a CUDA torch that is already importable; otherwise pin the CPU wheel 2.13.0
#      (an unpinned torch pulls a multi-GB CUDA build).
#   2. megatron-core's dependencies, transformers, datasets, ... (requirements.txt)
#   3. megatron-core 0.19.2 with --no-deps --ignore-requires-python (it declares >=3.12 but ships
#      a cp311 wheel that works; with deps it picks a numpy source build that fails on 3.11).
#   4. this package, editable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv
STAMP=$VENV/.mimo_sft_installed
want=$(cat requirements.txt pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
P=$VENV/bin/python
$P -m pip install -q --upgrade pip >/dev/null
if $P -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "[install] keeping the CUDA torch already in $VENV"
elif $P -c "import torch" 2>/dev/null && ! command -v nvidia-smi >/dev/null; then
  echo "[install] keeping torch $($P -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then
  echo "[install] GPU present: installing a CUDA torch"
  $P -m pip install -q "torch>=2.6"
else
  echo "[install] no CUDA: installing the CPU wheel torch==2.13.0"
  $P -m pip install -q torch==2.13.0
fi
TORCH_VER=$($P -c "import torch; print(torch.__version__.split('+')[0])")
# Constrain every later install to the torch we have, so no dependency can swap it.
echo "torch==$TORCH_VER" > $VENV/torch-constraint.txt
$P -m pip install -q -c $VENV/torch-constraint.txt -r requirements.txt
$P -m pip install -q --no-deps --ignore-requires-python megatron-core==0.19.2
$P -m pip install -q --no-deps -e .
echo "$want" > "$STAMP"
echo "[install] done: torch $TORCH_VER, $($P -c 'import transformers; print("transformers", transformers.__version__)')"
