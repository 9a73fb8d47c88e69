#!/usr/bin/env bash
# Create .venv and install mimo-sft with its dependencies. Idempotent: a stamp file records the
# hash of what was installed, so a second run installs nothing. Full guide: docs/install.md.
#
# Settings (environment or make variables):
#   PYTHON=/path/to/python  the interpreter .venv is made from (default python3.11, else python3).
#                           If it already imports a CUDA torch (an NVIDIA PyTorch container, a
#                           cluster module, your own venv), .venv is made on top of it and reuses
#                           that torch, and Transformer Engine / apex / megatron-core if present.
#   WHEELHOUSE=DIR          install everything from DIR, never from the network (build DIR with
#                           scripts/build_wheelhouse.sh on a machine with network).
#   MIMO_SFT_KEEP_TORCH=1   reuse the interpreter's torch even when it is a CPU build.
#
# Order matters:
#   1. torch: keep a CUDA torch that is importable (in .venv or from PYTHON); on a machine without a
#      GPU, pin the CPU wheel 2.13.0 (an unpinned torch pulls a multi-GB CUDA build). A GPU without
#      an importable CUDA torch is an error: this script never downloads a CUDA torch.
#   2. megatron-core's dependencies, transformers, datasets, ... (requirements.txt), constrained to
#      the torch of step 1 so that nothing can replace it.
#   3. megatron-core 0.19.2 with --no-deps --ignore-requires-python (it declares >=3.12 but ships
#      a cp311 wheel that works; with deps it picks a numpy source build that fails on 3.11).
#      An importable 0.19.2 is kept; another version is shadowed by 0.19.2 in .venv.
#   4. this package, editable.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
P=$VENV/bin/python
STAMP=$VENV/.mimo_sft_installed
BASE=$VENV/.mimo_sft_base        # sys.prefix of the interpreter .venv was made from
CPU_TORCH=2.13.0
MEGATRON=0.19.2
say() { echo "[install] $*"; }
die() { echo "[install] error: $*" >&2; exit 1; }

if [ -n "${WHEELHOUSE:-}" ]; then
  [ -d "$WHEELHOUSE" ] || die "WHEELHOUSE=$WHEELHOUSE is not a folder"
  WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
fi
want=$(cat requirements.txt pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ -n "${PYTHON:-}" ]; then
  PY=$(command -v "$PYTHON") || die "PYTHON=$PYTHON: no such interpreter"
  # An explicit PYTHON that is not the one .venv was made from: start .venv again from it.
  if [ -x $P ]; then
    had=$(cat "$BASE" 2>/dev/null || $P -c 'import sys; print(sys.base_prefix)')
    if [ "$had" != "$("$PY" -c 'import sys; print(sys.prefix)')" ]; then
      say "$VENV was made from $had, not from PYTHON=$PYTHON: making it again"
      rm -rf $VENV
    fi
  fi
else
  PY=$(command -v python3.11 || command -v python3) || die "no python3.11 or python3 on PATH; set PYTHON=/path/to/python"
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

# "VERSION CUDA" of the torch that interpreter $1 imports ("none none" without torch, CUDA "none"
# for a CPU build), then where it lives.
torch_of() {
  { "$1" - <<'EOF' 2>/dev/null || echo "none none -"; } | tail -n 1
try:
    import torch
except Exception:
    print("none none -")
else:
    import os
    print(torch.__version__, torch.version.cuda or "none", os.path.dirname(os.path.dirname(torch.__file__)))
EOF
}
gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then gpu=1; fi
no_cuda_torch() {
  die "this machine has a GPU but $1 imports no CUDA torch, and make install never downloads one (multi-GB): use an interpreter that has one (PYTHON=/path/to/python make install) or install a CUDA torch into $1 first"
}

if [ ! -x $P ]; then
  read -r t_ver t_cuda t_dir < <(torch_of "$PY")
  reuse=0
  if [ "$t_cuda" != none ]; then
    reuse=1
  elif [ "$t_ver" != none ] && [ "${MIMO_SFT_KEEP_TORCH:-0}" = 1 ]; then
    reuse=1
  elif [ $gpu = 1 ]; then
    no_cuda_torch "$PY"
  fi
  if [ $reuse = 1 ]; then
    [ "$t_cuda" = none ] && build="a CPU build" || build="CUDA $t_cuda"
    say "reusing torch $t_ver ($build) of $PY: $VENV sees its packages"
    if [ "$("$PY" -c 'import sys; print(sys.prefix != sys.base_prefix)')" = True ]; then
      # $PY is itself a venv: a venv made from it would see only the base interpreter's packages,
      # so point .venv at $PY's own site-packages (processing their .pth files), after its own.
      venv_args=()
      sites=$("$PY" -c 'import site; print(repr(site.getsitepackages()))')
    else
      venv_args=(--system-site-packages)
      sites=""
    fi
  else
    venv_args=()
    sites=""
  fi
  err=$(mktemp)
  if ! "$PY" -m venv "${venv_args[@]}" $VENV 2>"$err"; then
    # Debian/Ubuntu interpreters without python3-venv have no ensurepip; a venv that sees the
    # interpreter's packages can use its pip instead.
    rm -rf $VENV
    if [ $reuse = 1 ] && "$PY" -c 'import pip' 2>/dev/null; then
      "$PY" -m venv --without-pip "${venv_args[@]}" $VENV
    else
      cat "$err" >&2; rm -f "$err"
      die "could not create $VENV with $PY -m venv"
    fi
  fi
  rm -f "$err"
  if [ -n "$sites" ]; then
    $P -c 'import sys, sysconfig; print(sysconfig.get_paths()["purelib"])' | {
      read -r own
      echo "import site; list(map(site.addsitedir, $sites))" > "$own/_mimo_sft_base_env.pth"
    }
  fi
  "$PY" -c 'import sys; print(sys.prefix)' > "$BASE"
fi

PIP=("$P" -m pip install -q)
if [ -n "${WHEELHOUSE:-}" ]; then
  say "offline: installing only from $WHEELHOUSE"
  PIP+=(--no-index --find-links "$WHEELHOUSE")
else
  $P -m pip install -q --upgrade pip >/dev/null
fi
# pip install that, from a wheelhouse, names the package it lacks.
pip_install() {
  local log miss; log=$(mktemp)
  # (pipefail: the pipeline fails when pip does)
  if "${PIP[@]}" "$@" 2>&1 | tee "$log" >&2; then rm -f "$log"; return 0; fi
  miss=$(grep -oE 'No matching distribution found for [^ ]+' "$log" | head -n 1 | awk '{print $NF}') || true
  if [ -n "${WHEELHOUSE:-}" ] && [ -n "$miss" ]; then
    rm -f "$log"
    case "$miss" in torch[=\<\>]*|torch) die "$WHEELHOUSE has no $miss wheel, and scripts/build_wheelhouse.sh never adds one: use an interpreter that has torch (PYTHON=/path/to/python, plus MIMO_SFT_KEEP_TORCH=1 for a CPU build), or put a CPU torch wheel and its dependencies in $WHEELHOUSE (docs/install.md)" ;; esac
    die "$WHEELHOUSE has no wheel for $miss that fits $($P -c 'import sys; print("CPython %d.%d" % sys.version_info[:2])') here: add it, or rebuild the folder with scripts/build_wheelhouse.sh (docs/install.md)"
  fi
  rm -f "$log"
  die "pip install $* failed (pip's output above)"
}

read -r t_ver t_cuda t_dir < <(torch_of $P)
if [ "$t_cuda" != none ]; then
  say "keeping the CUDA torch $t_ver (CUDA $t_cuda) from $t_dir"
elif [ "$t_ver" != none ] && { [ $gpu = 0 ] || [ "${MIMO_SFT_KEEP_TORCH:-0}" = 1 ]; }; then
  say "keeping torch $t_ver from $t_dir"
elif [ $gpu = 1 ]; then
  no_cuda_torch "$P"
else
  say "no CUDA: installing the CPU wheel torch==$CPU_TORCH"
  pip_install torch==$CPU_TORCH
fi
TORCH_VER=$($P -c "
import importlib.metadata as m
try:
    print(m.version('torch'))
except m.PackageNotFoundError:
    import torch; print(torch.__version__)")
# Constrain every later install to the torch we have, so no dependency can swap it.
echo "torch==$TORCH_VER" > $VENV/torch-constraint.txt
pip_install -c $VENV/torch-constraint.txt -r requirements.txt
# torchvision (transformers' video processors and its torchvision image backend need it): the release
# paired with this torch (torch 2.N -> torchvision 0.(N+15)), --no-deps so that it can never bring another
# torch. One already importable is kept. Beside the CPU wheel its C++ library cannot load; mimo_sft's
# import hook (parallel/cpu_shims.torchvision_compat) makes its Python side import (docs/install.md).
if ! $P -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torchvision") is None)'; then
  TV_VER=$($P -c "v = '$TORCH_VER'.split('+')[0].split('.'); print('0.%d.%s' % (int(v[1]) + 15, v[2]))")
  if [ -n "${WHEELHOUSE:-}" ] && ! ls "$WHEELHOUSE"/torchvision-"$TV_VER"-*.whl >/dev/null 2>&1; then
    say "warning: $WHEELHOUSE has no torchvision $TV_VER wheel: installing without it (images use the PIL backend; video rows are refused)"
  else
    pip_install --no-deps torchvision==$TV_VER
  fi
fi

# megatron-core: the version pip sees, and the one `import megatron.core` would load (read from
# its package_info.py: importing it takes seconds). They differ when PYTHONPATH holds a checkout.
megatron_of() {
  $P - <<'EOF'
import importlib.metadata as m, importlib.util as u, os, re
try:
    dist = m.version("megatron-core")
except m.PackageNotFoundError:
    dist = "none"
try:
    spec = u.find_spec("megatron.core")
except Exception:
    spec = None
if spec is None or not spec.origin:
    print(dist, "none", "-")
else:
    d = os.path.dirname(spec.origin)
    try:
        text = open(os.path.join(d, "package_info.py")).read()
        v = ".".join(re.search(r"^%s = (\d+)" % k, text, re.M).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
    except Exception:
        v = "unknown"
    print(dist, v, d)
EOF
}
read -r m_dist m_ver m_dir < <(megatron_of)
if [ "$m_dist" = $MEGATRON ] && [ "$m_ver" = $MEGATRON ]; then
  case "$m_dir" in
    "$PWD/$VENV"/*) ;;
    *) say "keeping megatron-core $MEGATRON from $m_dir" ;;
  esac
else
  [ "$m_ver" = none ] || say "megatron-core $m_ver is importable from $m_dir; installing $MEGATRON into $VENV, which shadows it"
  pip_install -c $VENV/torch-constraint.txt --no-deps --ignore-requires-python megatron-core==$MEGATRON
  read -r m_dist m_ver m_dir < <(megatron_of)
  [ "$m_ver" = $MEGATRON ] || die "megatron.core still resolves to $m_ver at $m_dir, ahead of $MEGATRON in $VENV (PYTHONPATH, or a regular megatron package there); mimo-sft needs $MEGATRON"
fi
pip_install -c $VENV/torch-constraint.txt --no-deps -e .
echo "$want" > "$STAMP"
extras=$($P - <<'EOF'
import importlib.metadata as m
out = []
for name in ("transformers", "torchvision", "av", "transformer-engine", "apex"):
    try:
        out.append("%s %s" % (name, m.version(name)))
    except m.PackageNotFoundError:
        pass
print(", ".join(out))
EOF
)
[ "$t_cuda" = none ] && build=CPU || build="CUDA $t_cuda"
say "done: torch $TORCH_VER ($build), megatron-core $m_ver, $extras"
