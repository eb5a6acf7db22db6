#!/usr/bin/env bash
# One-time set-up of a fresh Debian/Ubuntu machine, as root: the packages the local
# cluster and the tests use, and the Python environment in .venv. Safe to re-run.
set -euo pipefail
trap 'echo "setup.sh: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "setup.sh: run as root (the local cluster needs network namespaces)" >&2
  exit 1
fi

# Keep package scripts from starting daemons: the local cluster starts its own.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
fi

pkgs=(slurm-wlm munge openssh-server openssh-client shellcheck cloud-init iproute2 procps
      psmisc util-linux python3 python3-venv python3-pip
      # The controller's metadata guard (tests/unit/test_imds_guard.py loads its rules with the real nft).
      nftables
      # The boot test (boottest/): images, containers (systemd-container must match the
      # host's systemd, which apt picks from the same release), the local apt repository.
      debootstrap systemd-container dpkg-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Re-install only when requirements.txt changed since the last successful install.
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -r requirements.txt
  echo "$want" > "$stamp"
fi
echo "setup.sh: ready (.venv/bin/fab, .venv/bin/pytest)"
