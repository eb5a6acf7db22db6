#!/bin/bash
# The local cluster's power programs: a GPU host "powers off" when its slurmd stops and
# "on" when it starts again. One file, installed under three names (localcluster/power_save.py):
#   slurm-gpu-suspend HOSTLIST  Slurm's SuspendProgram (run by slurmctld as SlurmUser on the controller)
#   slurm-gpu-resume HOSTLIST   Slurm's ResumeProgram (same)
#   slurm-gpu-power             the forced command of the power key on each GPU host (sshd runs it
#                               as root with SSH_ORIGINAL_COMMAND "stop" or "start")
# SlurmUser may not act on another host's daemons, so the controller side asks each host
# over SSH with a key that can do nothing but this, checking the host's pinned key.
# A host that does not start is handed to the AWS controller's own power program
# (bootstrap/scripts/power-ec2.py.j2, installed as slurm-gpu-power.py): its start-failed
# action tells Slurm at once, as on AWS.
set -euo pipefail
set -o errtrace

bin=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
state=$(dirname "$bin")
LOG=/var/log/slurm/slurm-gpu-power.log

node_side() {
  case ${SSH_ORIGINAL_COMMAND:-} in
    stop)  exec "$bin/hostctl" stop slurmd ;;
    # A powered-up node must report a boot newer than the power-up request (slurmd -b).
    start) SLURMD_REBOOTED=1 exec "$bin/hostctl" start slurmd ;;
    *) echo "slurm-gpu-power: refused '${SSH_ORIGINAL_COMMAND:-}' (only stop or start)" >&2; exit 2 ;;
  esac
}

controller_side() {
  local action=$1 hostlist=${2:-} host failed=0
  exec >>"$LOG" 2>&1
  trap 'echo "$(date -u +%FT%TZ) slurm-gpu-power: ${action} failed at line ${LINENO}"' ERR
  [ -n "$hostlist" ] || { echo "usage: $0 HOSTLIST"; exit 2; }
  echo "$(date -u +%FT%TZ) slurm-gpu-power: ${action} ${hostlist}"
  # Slurm accepts a node it powers up only if the node booted after the request, in whole
  # seconds: boot = now - uptime, and slurmd -b counts uptime in whole ticks, so it can look
  # a second older than it is. Started within the request's second, a slurmd may then look
  # booted before it; Slurm ignores its registration ("Still waiting for boot") and marks it
  # down after ResumeTimeout. A real boot never ends within that second: wait for the next.
  if [ "$action" = start ]; then
    local t0
    t0=$(date +%s)
    while [ "$(date +%s)" -le "$t0" ]; do sleep 0.05; done
  fi
  local out rc code
  for host in $(scontrol show hostnames "$hostlist"); do
    rc=0
    out=$(ssh -F /dev/null -i "$state/power/id_ed25519" -o IdentitiesOnly=yes -o BatchMode=yes \
        -o StrictHostKeyChecking=yes -o UserKnownHostsFile="$state/known_hosts" \
        -o GlobalKnownHostsFile=/dev/null -o ConnectTimeout=5 -l root "$host" "$action" 2>&1) || rc=$?
    [ -z "$out" ] || echo "$out"
    if [ "$rc" -ne 0 ]; then
      echo "$(date -u +%FT%TZ) slurm-gpu-power: ${action} on ${host} failed (exit ${rc})"
      failed=1
      if [ "$action" = start ]; then
        # ssh's own exit 255: the host did not answer; else its slurmd did not start.
        code=SlurmdStartFailed
        [ "$rc" -ne 255 ] || code=HostUnreachable
        python3 "$bin/slurm-gpu-power.py" start-failed "$host" "$code" "${out:-exit $rc}" || true
      fi
    fi
  done
  return "$failed"
}

case $(basename "$0") in
  slurm-gpu-suspend) controller_side stop "$@" ;;
  slurm-gpu-resume)  controller_side start "$@" ;;
  slurm-gpu-power)   node_side ;;
  *) echo "power.sh: install me as slurm-gpu-suspend, slurm-gpu-resume or slurm-gpu-power" >&2; exit 2 ;;
esac
