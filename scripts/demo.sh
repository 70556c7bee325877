#!/usr/bin/env bash
# Set up (if needed), build the embedded tiny H3 and run the main job on it; prints the mp4 path.
# The tiny H3 has random weights: the video and audio are noise. See docs/REAL_WEIGHTS.md.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$("$REPO/scripts/setup_env.sh")
PY="$VENV/bin/python"
OUT=${H3_DEMO_OUT:-$REPO/output/demo}
MODELS=${H3_MODELS:-$REPO/models/tiny}
mkdir -p "$OUT"
cd "$REPO"
[ -f "$MODELS/tiny.json" ] || "$PY" -m h3_core tiny --out "$MODELS" >/dev/null
"$PY" -m h3_core encode --models "$MODELS" --prompt "A red fox trots through fresh snow at dawn; wind, crunching steps." \
  --out "$OUT/t2va.cond.safetensors" >/dev/null
"$PY" -m h3_core generate --models "$MODELS" --cond "$OUT/t2va.cond.safetensors" --steps 4 --seed 0 \
  --out "$OUT/t2va.mp4" >/dev/null
echo "$OUT/t2va.mp4"
