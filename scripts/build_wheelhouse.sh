#!/usr/bin/env bash
# Build a wheelhouse: a folder of wheels from which `WHEELHOUSE=DIR make install` installs mimo-sft
# on a machine without network. Run it on a machine WITH network, for the target's Python.
#
#   scripts/build_wheelhouse.sh OUT_DIR [--python-version 3.12] [--glibc 2.28] [--arch x86_64]
#                               [--platform TAG]...
#
#   --python-version  CPython X.Y of the target interpreter (default: this machine's, see below)
#   --glibc           newest manylinux glibc the target may use (default 2.28: RHEL 8, Ubuntu 20.04+)
#   --arch            x86_64 or aarch64 (default: this machine's)
#   --platform TAG    exact wheel platform tag(s) instead of the --glibc/--arch set (repeatable)
#
# What goes in, and why this way: requirements.txt is resolved WITH its dependencies (so the folder
# is complete whatever the target already has: datasets' dill/multiprocess/xxhash/fsspec/pyarrow/
# pandas/huggingface-hub, transformers' tokenizers/safetensors/regex, ...), plus setuptools and wheel
# (to build this package's editable install offline), plus megatron-core without dependencies (its
# only declared ones are torch, numpy and packaging; the last two come with requirements.txt).
# torch is never downloaded: nothing in the list depends on it, and a constraint that no torch
# release meets keeps it out of the resolution should that change (pip then fails, or settles on an
# older release that does not need torch). So there are no nvidia-* or triton wheels either: the
# target must bring its own torch (see docs/install.md).
#
# Environment markers (platform_machine, sys_platform) are evaluated for THIS machine: build on the
# same OS and architecture as the target. The interpreter that runs pip: $PYTHON, else python3.
set -euo pipefail

MEGATRON=megatron-core==0.19.2
usage() { sed -n '5,11p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
die() { echo "[wheelhouse] error: $*" >&2; exit 1; }

[ $# -ge 1 ] || usage
case "$1" in -h|--help) usage 0 ;; -*) usage ;; esac
OUT=$1; shift
PYVER=""; GLIBC=2.28; ARCH=$(uname -m); PLATFORMS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYVER=${2:?}; shift 2 ;;
    --glibc) GLIBC=${2:?}; shift 2 ;;
    --arch) ARCH=${2:?}; shift 2 ;;
    --platform) PLATFORMS+=("${2:?}"); shift 2 ;;
    -h|--help) usage 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || die "no interpreter $PY to run pip (set PYTHON=...)"
[ -n "$PYVER" ] || PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ "$PYVER" =~ ^3\.[0-9]+$ ]] || die "--python-version wants X.Y, e.g. 3.12 (got $PYVER)"
case "$ARCH" in x86_64|aarch64) ;; *) die "--arch must be x86_64 or aarch64 (got $ARCH)" ;; esac
if [ ${#PLATFORMS[@]} -gt 0 ]; then
  DESC="${PLATFORMS[*]}"
else
  DESC="manylinux, glibc <= $GLIBC, $ARCH"
  [[ "$GLIBC" =~ ^2\.([0-9]+)$ ]] || die "--glibc wants 2.N, e.g. 2.28 (got $GLIBC)"
  # pip matches platform tags exactly: list every manylinux level up to the target's glibc.
  for ((m = 17; m <= BASH_REMATCH[1]; m++)); do PLATFORMS+=("manylinux_2_${m}_$ARCH"); done
  PLATFORMS+=("manylinux2014_$ARCH")
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo 'torch<0  # matches no release: nothing in the wheelhouse may pull in torch' > "$TMP/no-torch.txt"

TARGET=(--only-binary=:all: --implementation cp --python-version "$PYVER")
for p in "${PLATFORMS[@]}"; do TARGET+=(--platform "$p"); done
echo "[wheelhouse] CPython $PYVER, $DESC, into $OUT"

"$PY" -m pip download -q "${TARGET[@]}" -d "$OUT" -c "$TMP/no-torch.txt" \
  -r "$ROOT/requirements.txt" setuptools wheel
"$PY" -m pip download -q "${TARGET[@]}" -d "$OUT" --no-deps --ignore-requires-python "$MEGATRON"

shopt -s nullglob
stray=("$OUT"/torch-* "$OUT"/nvidia_* "$OUT"/triton-*)
[ ${#stray[@]} -eq 0 ] || echo "[wheelhouse] warning: torch-related wheels in $OUT (left there by an earlier run?): ${stray[*]##*/}" >&2
wheels=("$OUT"/*.whl)
echo "[wheelhouse] $OUT: ${#wheels[@]} wheels, $(du -sh "$OUT" | cut -f1)"
echo "[wheelhouse] on the target: PYTHON=/path/to/python$PYVER WHEELHOUSE=$OUT make install"
