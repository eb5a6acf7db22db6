"""The files the hosts mount, written under the state dir before any host starts: the
cluster's rendered config (bootstrap/), SSH keys, the power-save programs, and each
host's own directories."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from bootstrap import node_layout, render, user_data
from cluster import hostpaths
from cluster.facts import ClusterFacts
from localcluster import daemons, hosts
from localcluster import power_save as power
from localcluster import topology as layout
from localcluster.state import HostSpec
from ops.ssh import hostkeys

HOSTCTL_SRC = Path(__file__).resolve().parent / "hostctl.sh"
# The cluster's network has no DNS server: every name is in /etc/hosts. The machine's own nameserver is
# not reachable from the bridge, so each lookup that fell through to DNS (an IPv6 address, a reverse
# lookup: torchrun's rendezvous makes several) waited 5 s twice. Here a query goes to the host's own
# loopback, where nothing listens, and fails at once; no query leaves the cluster's network.
RESOLV_CONF = ("# slurm-gpu local cluster: no DNS server (names are in /etc/hosts)\n"
               "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


def install_dir(path: Path, mode: int, owner: str = "root") -> None:
    path.mkdir(parents=True, exist_ok=True)
    shutil.chown(path, owner, owner)
    path.chmod(mode)


def write_file(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _keygen(path: Path, comment: str) -> None:
    if not path.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                       check=True)


def _ssh_keys(specs: list[HostSpec]) -> None:
    """The cluster's key pair (kept across `down`), its authorized_keys, each host's host key."""
    install_dir(layout.SSH_DIR, 0o700)
    _keygen(layout.CLUSTER_KEY, "slurm-gpu-local")
    write_file(layout.AUTHORIZED_KEYS, layout.CLUSTER_KEY.with_suffix(".pub").read_text(), 0o600)
    for s in specs:
        _keygen(layout.host_key(s.name), s.name)


def _power_programs(facts: ClusterFacts) -> None:
    """The power-save programs (localcluster/power_save.py), SlurmUser's key, and its restricted line
    in the hosts' authorized_keys (call after the cluster's own authorized_keys is written)."""
    for dest in (power.SUSPEND, power.RESUME, power.NODE_COMMAND):
        shutil.copyfile(power.SOURCE, dest)
        dest.chmod(0o755)  # slurmctld refuses a program that is group or world writable
    write_file(power.SHARED, render.render_power_program(facts), 0o755)
    power.KEY_DIR.mkdir(mode=0o700, exist_ok=True)
    shutil.chown(power.KEY_DIR, power.SLURM_USER, power.SLURM_USER)
    _keygen(power.KEY, "slurm-gpu-local-power")
    for path in (power.KEY, power.KEY.with_suffix(".pub")):
        shutil.chown(path, power.SLURM_USER, power.SLURM_USER)
    power.KEY.chmod(0o600)
    line = f'restrict,command="{power.NODE_COMMAND}" {power.KEY.with_suffix(".pub").read_text().strip()}\n'
    with open(layout.AUTHORIZED_KEYS, "a") as f:
        f.write(line)


def write_files(facts: ClusterFacts, specs: list[HostSpec]) -> None:
    """Everything the hosts mount: the cluster's config and each host's own dirs."""
    install_dir(layout.STATE, 0o755)
    for d in (layout.ETC_SLURM, layout.ETC_SLURM_GPU, layout.BIN_DIR, layout.HOSTS_DIR):
        install_dir(d, 0o755)
    if not layout.SCRATCH.exists():
        install_dir(layout.SCRATCH, 0o755)
    rendered = render.render_files(facts)
    write_file(layout.ETC_SLURM / Path(node_layout.SLURM_CONF).name, rendered[node_layout.SLURM_CONF])
    write_file(layout.ETC_SLURM / Path(node_layout.GRES_CONF).name, rendered[node_layout.GRES_CONF])
    if node_layout.CGROUP_CONF in rendered:  # not on the LOCAL platform (no cgroups)
        write_file(layout.ETC_SLURM / Path(node_layout.CGROUP_CONF).name, rendered[node_layout.CGROUP_CONF])
    block = rendered[node_layout.HOSTS_BLOCK_FILE]
    write_file(layout.ETC_SLURM_GPU / Path(node_layout.HOSTS_BLOCK_FILE).name, block)
    # GPU hosts run slurmd configless (hostctl reads --conf-server from here), as on AWS.
    write_file(layout.ETC_SLURM_GPU / Path(node_layout.SLURMD_ENV_FILE).name, rendered[node_layout.SLURMD_ENV_FILE])
    shutil.copyfile(HOSTCTL_SRC, layout.HOSTCTL)
    layout.HOSTCTL.chmod(0o755)
    _ssh_keys(specs)
    hostkeys.write_known_hosts(layout.KNOWN_HOSTS, [
        ((s.name, s.ip), [layout.host_key(s.name).with_suffix(".pub").read_text()]) for s in specs])
    if facts.power_save is not None:
        _power_programs(facts)
    for s in specs:
        d = layout.host_dir(s.name)
        install_dir(d, 0o755)
        install_dir(d / "etc-munge", 0o700, "munge")  # empty: bootstrap makes the key
        install_dir(d / "lib-munge", 0o711, "munge")
        install_dir(d / "log-munge", 0o700, "munge")
        install_dir(d / "lib-slurm", 0o755, "slurm")
        install_dir(d / "log-slurm", 0o755, "slurm")
        install_dir(d / "sbin", 0o755)
        install_dir(d / "etc-slurm", 0o755)  # a GPU host's /etc/slurm: empty (configless)
        write_file(d / "hosts", "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n")
        write_file(d / "hostname", s.name + "\n")
        write_file(d / "resolv.conf", RESOLV_CONF)
        write_file(d / "sshd_config", daemons.sshd_config(s.name, s.ip))
        write_file(d / "sbin" / Path(hostpaths.BOOTSTRAP_PATH).name,
                   user_data.bootstrap_files(facts, s.role, s.name)[hostpaths.BOOTSTRAP_PATH], 0o755)
        if s.role == "gpu":
            write_file(d / "sbin" / Path(hostpaths.HEALTHCHECK_PATH).name,
                       rendered[hostpaths.HEALTHCHECK_PATH], 0o755)
            standin = d / "lib-slurm" / Path(layout.GPU_DEVICE_PREFIX).parent.name
            install_dir(standin, 0o755)
            for i in range(facts.shape.gpu_count):
                (standin / f"{Path(layout.GPU_DEVICE_PREFIX).name}{i}").touch()


def host_mounts(s: HostSpec) -> list[hosts.Mount]:
    """What a host's holder bind-mounts: its own dirs, then the cluster's shared ones."""
    d = layout.host_dir(s.name)
    own = [("etc-munge", "/etc/munge"), ("lib-munge", "/var/lib/munge"),
           ("log-munge", "/var/log/munge"), ("lib-slurm", "/var/lib/slurm"),
           ("log-slurm", "/var/log/slurm"), ("sbin", "/usr/local/sbin"),
           ("hosts", "/etc/hosts"), ("hostname", "/etc/hostname"), ("resolv.conf", "/etc/resolv.conf")]
    shared = [(layout.ETC_SLURM_GPU, "/etc/slurm-gpu"), (layout.SCRATCH, "/scratch")]
    # The controller holds the cluster's slurm.conf and gres.conf; GPU hosts get an empty
    # /etc/slurm of their own and fetch both from slurmctld (configless), as on AWS.
    if s.role == "controller":
        shared.append((layout.ETC_SLURM, "/etc/slurm"))
    else:
        own.append(("etc-slurm", "/etc/slurm"))
    return [hosts.Mount(d / src, dst) for src, dst in own] + [hosts.Mount(src, dst) for src, dst in shared]
