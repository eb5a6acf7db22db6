#!/usr/bin/env bash
# README's second command: set up, then run every test (the local-cluster tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tests that bring up the local cluster tear it down themselves; this is the backstop.
trap '.venv/bin/fab local.down >/dev/null 2>&1 || true' EXIT
.venv/bin/pytest -q "$@"
