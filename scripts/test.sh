#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest.
#   bash scripts/test.sh           everything (what CI runs), on three pytest-xdist workers (H3_TEST_WORKERS=0: one
#                                  process); whole modules per worker (tests/conftest.py, "pytest-xdist workers")
#   bash scripts/test.sh --fast    the fast tier: no tiny-model runs, ComfyUI, Ray or server processes (tiers:
#                                  tests/conftest.py TIERS); about a minute, for the inner loop
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FAST=0
if [[ "${1:-}" == "--fast" ]]; then
  FAST=1
  shift
fi
VENV=$("$REPO/scripts/setup_env.sh")
# ComfyUI 0.3.75 + chromium + playwright-core for the in-ComfyUI tests (fast when already set up; the fast tier
# starts no ComfyUI).
if [[ $FAST == 0 ]]; then
  H3_VENV="$VENV" bash "$REPO/scripts/setup_comfyui.sh"
fi
cd "$REPO"
# Lint first (configuration in pyproject.toml): a style error fails the run like a failing test.
"$VENV/bin/ruff" check .
# Fixed thread count: bitwise stage-split parity assumes it (docs/ARCHITECTURE.md §2.1, trap 5).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} H3_THREADS=${H3_THREADS:-2}
# OpenMP threads that finish a parallel region sleep instead of spinning. The tests run several torch processes at
# once (a server and its client, ComfyUI and an encoder, two workers): with spinning threads two tiny-H3 generates
# side by side took 14.8-17.1 s on 2 cores, with sleeping ones 8.0-8.4 s, as long as one alone (7.3-7.9 s). It
# changes no result (same bytes); only how idle threads wait.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
if [[ $FAST == 1 ]]; then
  exec "$VENV/bin/python" -m pytest -q --fast "$@"  # = -m "not slow and not comfyui and not ray and not process"
fi
# Byte-compile the pack and ComfyUI once: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) no
# process writes its .pyc, so each of the suite's Python processes (servers, ComfyUI, ranks, CLI runs) compiled them
# again: 0.5-0.7 CPU-s a process (measured importing the pack, and ComfyUI), for about 3 CPU-s once here (both ComfyUIs).
"$VENV/bin/python" -m compileall -q -j 2 h3_core nodes bench workflows tests .comfyui $([[ -d .comfyui-0.33 ]] && echo .comfyui-0.33) >/dev/null
# The 25 slowest tests at the end: where the suite's time goes, in every CI log.
# Three workers on two cores: the tests wait a third of their time (servers starting, browsers, a client waiting on
# its server), so a third worker fills it. Clean clone, 2 cores: tests 19:51 on two workers, 18:00 on three, the same
# CPU (28.0 and 27.5 CPU-minutes; 2026-12-07); each worker ends within 0.2 min of the others.
WORKERS=${H3_TEST_WORKERS:-3}
if [[ $WORKERS == 0 ]]; then
  exec "$VENV/bin/python" -m pytest -q --durations=25 "$@"
fi
exec "$VENV/bin/python" -m pytest -q --durations=25 -n "$WORKERS" --dist loadscope --no-loadscope-reorder "$@"
