#!/usr/bin/env bash
# README's first command: set up, start the local cluster, run the fine-tune on it with
# `fab train --target local`, show the summary, and take the cluster down again.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
trap '.venv/bin/fab local.down' EXIT
.venv/bin/fab local.up
.venv/bin/fab train --target local
