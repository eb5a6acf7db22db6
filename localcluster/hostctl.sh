#!/bin/bash
# hostctl ACTION SERVICE - the local cluster's stand-in for `systemctl ACTION SERVICE`.
# Runs inside one local-cluster host (over ssh, or via nsenter from `fab local.*`):
# ACTION is start, stop, restart or status; SERVICE is munge, sshd, slurmctld or slurmd.
# Daemons are tracked by their pid files in the host's private /run.
set -euo pipefail
trap 'echo "hostctl: ${action:-?} ${service:-?} failed at line $LINENO" >&2' ERR

usage() { echo "usage: hostctl start|stop|restart|status munge|sshd|slurmctld|slurmd" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1 service=$2
state=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
host=$(hostname)

# A slurm.conf path setting with %n (node name) expanded, or the default.
slurm_setting() {
  local value=
  # GPU hosts run slurmd configless: they have no local slurm.conf.
  if [ -r /etc/slurm/slurm.conf ]; then
    value=$(sed -n "s/^[[:space:]]*$1[[:space:]]*=[[:space:]]*\([^[:space:]#]*\).*/\1/Ip" \
      /etc/slurm/slurm.conf | tail -n 1)
  fi
  value=${value:-$2}
  echo "${value//%n/$host}"
}

case $service in
  munge)     pidfile=/run/munge/munged.pid
             cmd=(runuser -u munge -- /usr/sbin/munged) ;;
  sshd)      pidfile=/run/sshd.pid
             cmd=(/usr/sbin/sshd -f "$state/hosts/$host/sshd_config") ;;
  slurmctld) pidfile=$(slurm_setting SlurmctldPidFile /run/slurmctld.pid)
             cmd=(/usr/sbin/slurmctld) ;;
  slurmd)    pidfile=$(slurm_setting SlurmdPidFile /run/slurmd.pid)
             # The options systemd gives slurmd on AWS (--conf-server: configless).
             # shellcheck source=/dev/null
             read -ra opts <<< "$(SLURMD_OPTIONS=; . /etc/slurm-gpu/slurmd.env 2>/dev/null || true
                                  echo "$SLURMD_OPTIONS")"
             # SLURMD_REBOOTED=1 (the local power programs' "power on"): slurmd -b reports a
             # fresh boot, which Slurm requires of a node it is powering up.
             [ "${SLURMD_REBOOTED:-0}" = 1 ] && opts+=(-b)
             cmd=(/usr/sbin/slurmd -N "$host" "${opts[@]}") ;;
  *) usage ;;
esac

# Whether process $1 runs. One that has exited but is not reaped yet (a zombie: this machine's init
# takes a second or two to reap an orphaned daemon) is stopped: it holds no socket, port or file.
alive() {
  local state
  state=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$1/status" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

running_pid() {
  local pid
  pid=$(cat "$pidfile" 2>/dev/null) || return 1
  [ -n "$pid" ] && alive "$pid" && echo "$pid"
}

start() {
  local out
  if running_pid >/dev/null; then return 0; fi
  out=$(mktemp)
  # The daemons fork into the background; their early errors land in $out.
  if ! "${cmd[@]}" </dev/null >"$out" 2>&1; then
    echo "hostctl: $service failed to start on $host:" >&2
    cat "$out" >&2
    rm -f "$out"
    return 1
  fi
  rm -f "$out"
}

stop() {
  local pid i
  pid=$(running_pid) || { rm -f "$pidfile"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 200); do
    alive "$pid" || { rm -f "$pidfile"; return 0; }
    sleep 0.05
    [ "$i" -eq 100 ] && kill -KILL "$pid" 2>/dev/null
  done
  echo "hostctl: $service (pid $pid) did not stop on $host" >&2
  return 1
}

case $action in
  start) start ;;
  stop) stop ;;
  restart) stop; start ;;
  status) if pid=$(running_pid); then echo "$service running (pid $pid) on $host"
          else echo "$service stopped on $host"; exit 3; fi ;;
  *) usage ;;
esac
