#!/usr/bin/env bash
# README's second command: set up, then run every test (the local-cluster tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tests that bring up the local cluster tear it down themselves; this is the backstop.
trap '.venv/bin/fab local.down >/dev/null 2>&1 || true; .venv/bin/python -m boottest.teardown >/dev/null 2>&1 || true' EXIT
# Lint first: it takes a second and names the file and line (pyproject.toml holds the rules).
.venv/bin/ruff check .
# --durations: where the run spends its time, printed at the end (CI has a 35-minute budget).
.venv/bin/pytest -q --durations=25 "$@"
