#!/usr/bin/env bash
# Set up (if needed) and run the main job, disaggregated, on the embedded tiny H3: the H3 encoder
# endpoint and a real ComfyUI on loopback, the shipped remote-encoder workflow run headlessly.
# Prints the path of the mp4. The tiny H3 has random weights: its video and audio are noise.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$("$REPO/scripts/setup_env.sh")
H3_VENV="$VENV" H3_SKIP_UI_SETUP=1 bash "$REPO/scripts/setup_comfyui.sh" >&2
cd "$REPO"
exec "$VENV/bin/python" scripts/demo.py
