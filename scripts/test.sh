#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$("$REPO/scripts/setup_env.sh")
# ComfyUI 0.3.75 + chromium + playwright-core for the in-ComfyUI tests (fast when already set up).
H3_VENV="$VENV" bash "$REPO/scripts/setup_comfyui.sh"
cd "$REPO"
# Lint first (configuration in pyproject.toml): a style error fails the run like a failing test.
"$VENV/bin/ruff" check .
# Fixed thread count: bitwise stage-split parity assumes it (docs/ARCHITECTURE.md §2.1, trap 5).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} H3_THREADS=${H3_THREADS:-2}
exec "$VENV/bin/python" -m pytest -q "$@"
