#!/usr/bin/env bash
# README's second command: set up, then run every test (the local-cluster and boot tests included).
# With arguments, they go to one pytest run as they are (`bash scripts/test.sh tests/unit -k spot`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BOOT_PID=
# Tests that bring up the local cluster tear it down themselves; this is the backstop.
trap '[ -z "$BOOT_PID" ] || kill "$BOOT_PID" 2>/dev/null || true; wait 2>/dev/null || true
      .venv/bin/fab local.down >/dev/null 2>&1 || true; .venv/bin/python -m boottest.teardown >/dev/null 2>&1 || true' EXIT
# Lint first: it takes a second and names the file and line (pyproject.toml holds the rules).
.venv/bin/ruff check .
# --durations: where each run spends its time, printed at its end (CI has a 40-minute budget).
if [ $# -gt 0 ]; then
  exec .venv/bin/pytest -q --durations=25 "$@"
fi
# The tiers (docs/ARCHITECTURE.md). The boot test (containers on their own bridge and /24, about
# 13 minutes, most of it waiting on first boots) runs beside the unit tier, which brings up no
# cluster; the cluster tier runs after both, alone: its checks that nothing is left look at every
# process on the machine, and the boot test's containers run Slurm and Munge daemons too.
BOOT_LOG=$(mktemp /tmp/slurm-gpu-boot-tier.XXXXXX.log)
.venv/bin/pytest -q -p no:cacheprovider --durations=10 tests/boot > "$BOOT_LOG" 2>&1 &
BOOT_PID=$!
rc_unit=0 rc_boot=0 rc_cluster=0
echo "== unit tier (the boot tier runs beside it; its output follows, from ${BOOT_LOG})"
.venv/bin/pytest -q --durations=15 tests/unit || rc_unit=$?
wait "$BOOT_PID" || rc_boot=$?
BOOT_PID=
echo "== boot tier"
cat "$BOOT_LOG"
echo "== cluster tier"
.venv/bin/pytest -q --durations=15 tests/cluster || rc_cluster=$?
echo "== exit status: unit ${rc_unit}, boot ${rc_boot}, cluster ${rc_cluster}"
[ "$rc_unit" = 0 ] && [ "$rc_boot" = 0 ] && [ "$rc_cluster" = 0 ]
