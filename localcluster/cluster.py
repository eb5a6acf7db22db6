"""The local cluster: `up`, `down` and `status` (the bodies of `fab local.*`).

A controller and N GPU hosts, each a set of namespaces on bridge sgpu0, running
real munged, sshd, slurmctld and slurmd with the files bootstrap/ renders for
AWS and the same bootstrap scripts (minus the steps a namespace host cannot do).

`up` on a healthy cluster of the same size does nothing; with another size it
refuses and says to run `fab local.down` first (a running cluster may hold jobs).
A cluster found broken (a host or daemon gone) is taken down and made again.
Any failure during `up` takes down what was made before the error is raised.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bootstrap import render
from bootstrap.facts import ClusterFacts, NodeShape, plan_hosts
from bootstrap.inventory import Inventory, from_facts
from bootstrap.platform import LOCAL
from localcluster import daemons, hosts, layout, netns, power
from ops import hostkeys

REPO = Path(__file__).resolve().parent.parent
HOSTCTL_SRC = Path(__file__).resolve().parent / "hostctl.sh"
REQUIRED_TOOLS = {
    "ip": "iproute2", "nsenter": "util-linux", "unshare": "util-linux", "runuser": "util-linux",
    "munged": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sshd": "openssh-server",
    "ssh-keygen": "openssh-client",
}
Out = Callable[[str], None]


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class HostSpec:
    name: str
    ip: str
    role: str  # "controller" or "gpu"
    index: int  # 0 = controller, i = gpu-node-i

    @property
    def netns(self) -> str:
        return layout.netns_name(self.name)


# ---------------------------------------------------------------- validation


def validate(nodes, gpus) -> tuple[int, int]:
    """Checked option values, or a ClusterError naming the option and the fix."""

    def as_int(value, flag: str, lo: int, hi: int) -> int:
        try:
            number = int(str(value).strip())
        except (TypeError, ValueError):
            number = None
        if number is None or str(number) != str(value).strip().lstrip("+") or not lo <= number <= hi:
            raise ClusterError(f"{flag} must be a whole number from {lo} to {hi} (got {value!r}); "
                               f"e.g. `fab local.up {flag} {lo + 1 if hi > lo else lo}`")
        return number

    return (as_int(nodes, "--nodes", layout.MIN_NODES, layout.MAX_NODES),
            as_int(gpus, "--gpus", layout.MIN_GPUS, layout.MAX_GPUS))


def preflight() -> None:
    if os.geteuid() != 0:
        raise ClusterError("the local cluster needs root (network namespaces): run `sudo fab local.up`")
    missing = sorted({pkg for tool, pkg in REQUIRED_TOOLS.items() if not shutil.which(tool)})
    if missing:
        raise ClusterError(f"missing packages: {', '.join(missing)}; run `bash scripts/setup.sh`")


# ---------------------------------------------------------------- state


def plan(nodes: int) -> list[HostSpec]:
    ctl, gpu_hosts = plan_hosts(layout.SUBNET, nodes)
    return [HostSpec(ctl.name, ctl.ip, "controller", 0)] + [
        HostSpec(h.name, h.ip, "gpu", i) for i, h in enumerate(gpu_hosts, start=1)
    ]


def load_state() -> dict | None:
    try:
        return json.loads(layout.STATE_FILE.read_text())
    except (OSError, ValueError):
        return None


def save_state(state: dict) -> None:
    tmp = layout.STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(layout.STATE_FILE)


@contextmanager
def op_lock():
    layout.OP_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(layout.OP_LOCK, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClusterError("another `fab local.*` is running; wait for it to finish") from None
        yield


# ---------------------------------------------------------------- facts and files


def machine_shape(gpus: int) -> NodeShape:
    """What every GPU host reports: this machine's CPUs, memory a little under its own."""
    mem_kib = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                   if ln.startswith("MemTotal:"))
    return NodeShape(cpus=os.cpu_count() or 1, real_memory_mib=int(mem_kib / 1024 * 0.9),
                     gpu_count=gpus, gpu_type=layout.GPU_TYPE)


def cluster_facts(nodes: int, gpus: int, idle_stop_s: int = 0) -> ClusterFacts:
    ctl, gpu_hosts = plan_hosts(layout.SUBNET, nodes)
    return ClusterFacts(
        cluster_name=layout.CLUSTER_NAME, controller=ctl, gpu_nodes=gpu_hosts,
        shape=machine_shape(gpus), subnet_cidr=layout.SUBNET, ssh_user="root",
        scratch="/scratch", platform=LOCAL, efa=False, nvlink=False,
        # A lost host is marked DOWN (and its job requeued) in seconds, not AWS's 180 s. The
        # requeued job waits cred_expire before it starts again; it must stay above slurmctld's
        # 60 s retry of the terminate request to the lost node, or that late retry kills the new
        # attempt (same job id) when the node is back.
        slurmd_timeout=15, cred_expire=70, power_save=power.power_save(idle_stop_s),
    )


def _install_dir(path: Path, mode: int, owner: str = "root") -> None:
    path.mkdir(parents=True, exist_ok=True)
    shutil.chown(path, owner, owner)
    path.chmod(mode)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _ssh_keys(specs: list[HostSpec]) -> None:
    _install_dir(layout.SSH_DIR, 0o700)
    if not layout.CLUSTER_KEY.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "slurm-gpu-local",
                        "-f", str(layout.CLUSTER_KEY)], check=True)
    pub = layout.CLUSTER_KEY.with_suffix(".pub").read_text()
    _write(layout.AUTHORIZED_KEYS, pub, 0o600)
    for s in specs:
        if not layout.host_key(s.name).exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", s.name,
                            "-f", str(layout.host_key(s.name))], check=True)


def write_files(facts: ClusterFacts, specs: list[HostSpec]) -> None:
    """Everything the hosts mount: the cluster's config and each host's own dirs."""
    _install_dir(layout.STATE, 0o755)
    for d in (layout.ETC_SLURM, layout.ETC_SLURM_GPU, layout.BIN_DIR, layout.HOSTS_DIR):
        _install_dir(d, 0o755)
    if not layout.SCRATCH.exists():
        _install_dir(layout.SCRATCH, 0o755)
    rendered = render.render_files(facts)
    _write(layout.ETC_SLURM / Path(render.SLURM_CONF).name, rendered[render.SLURM_CONF])
    _write(layout.ETC_SLURM / Path(render.GRES_CONF).name, rendered[render.GRES_CONF])
    if render.CGROUP_CONF in rendered:  # not on the LOCAL platform (no cgroups)
        _write(layout.ETC_SLURM / Path(render.CGROUP_CONF).name, rendered[render.CGROUP_CONF])
    block = rendered[render.HOSTS_BLOCK_FILE]
    _write(layout.ETC_SLURM_GPU / Path(render.HOSTS_BLOCK_FILE).name, block)
    # GPU hosts run slurmd configless (hostctl reads --conf-server from here), as on AWS.
    _write(layout.ETC_SLURM_GPU / Path(render.SLURMD_ENV_FILE).name, rendered[render.SLURMD_ENV_FILE])
    shutil.copyfile(HOSTCTL_SRC, layout.HOSTCTL)
    layout.HOSTCTL.chmod(0o755)
    _ssh_keys(specs)
    hostkeys.write_known_hosts(layout.KNOWN_HOSTS, [
        ((s.name, s.ip), [layout.host_key(s.name).with_suffix(".pub").read_text()]) for s in specs])
    if facts.power_save is not None:
        power.install()
    for s in specs:
        d = layout.host_dir(s.name)
        _install_dir(d, 0o755)
        _install_dir(d / "etc-munge", 0o700, "munge")  # empty: bootstrap makes the key
        _install_dir(d / "lib-munge", 0o711, "munge")
        _install_dir(d / "log-munge", 0o700, "munge")
        _install_dir(d / "lib-slurm", 0o755, "slurm")
        _install_dir(d / "log-slurm", 0o755, "slurm")
        _install_dir(d / "sbin", 0o755)
        _install_dir(d / "etc-slurm", 0o755)  # a GPU host's /etc/slurm: empty (configless)
        _write(d / "hosts", "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n")
        _write(d / "hostname", s.name + "\n")
        _write(d / "sshd_config", daemons.sshd_config(s.name, s.ip))
        _write(d / "sbin" / Path(render.BOOTSTRAP_PATH).name,
               render.bootstrap_script(facts, s.role, s.name), 0o755)
        if s.role == "gpu":
            _write(d / "sbin" / Path(render.HEALTHCHECK_PATH).name,
                   rendered[render.HEALTHCHECK_PATH], 0o755)
            standin = d / "lib-slurm" / Path(layout.GPU_DEVICE_PREFIX).parent.name
            _install_dir(standin, 0o755)
            for i in range(facts.shape.gpu_count):
                (standin / f"{Path(layout.GPU_DEVICE_PREFIX).name}{i}").touch()


def host_mounts(s: HostSpec) -> list[hosts.Mount]:
    d = layout.host_dir(s.name)
    own = [("etc-munge", "/etc/munge"), ("lib-munge", "/var/lib/munge"),
           ("log-munge", "/var/log/munge"), ("lib-slurm", "/var/lib/slurm"),
           ("log-slurm", "/var/log/slurm"), ("sbin", "/usr/local/sbin"),
           ("hosts", "/etc/hosts"), ("hostname", "/etc/hostname")]
    shared = [(layout.ETC_SLURM_GPU, "/etc/slurm-gpu"), (layout.SCRATCH, "/scratch")]
    # The controller holds the cluster's slurm.conf and gres.conf; GPU hosts get an empty
    # /etc/slurm of their own and fetch both from slurmctld (configless), as on AWS.
    if s.role == "controller":
        shared.append((layout.ETC_SLURM, "/etc/slurm"))
    else:
        own.append(("etc-slurm", "/etc/slurm"))
    return [hosts.Mount(d / src, dst) for src, dst in own] + [hosts.Mount(src, dst) for src, dst in shared]


# ---------------------------------------------------------------- up


def up(nodes=layout.DEFAULT_NODES, gpus=layout.DEFAULT_GPUS, fresh_keys: bool = False,
       out: Out = print, idle_stop_s=0) -> Inventory:
    """Bring the cluster up (see the module docstring); returns its inventory.
    idle_stop_s > 0: Slurm stops a GPU host's slurmd after that many idle seconds."""
    nodes, gpus = validate(nodes, gpus)
    idle_stop_s = power.validate_idle_stop(idle_stop_s)
    preflight()
    with op_lock():
        state = load_state()
        if state is not None:
            if (state["nodes"], state["gpus"], state.get("idle_stop_s", 0)) != (nodes, gpus, idle_stop_s):
                raise ClusterError(
                    f"a local cluster with {state['nodes']} GPU hosts x {state['gpus']} GPUs "
                    f"(idle stop {state.get('idle_stop_s', 0)} s) is already up; run `fab local.down` first "
                    f"to make one with {nodes} x {gpus} (idle stop {idle_stop_s} s)")
            problems = health(state)
            if not problems:
                out(f"local cluster already up ({nodes} GPU hosts x {gpus} GPUs); nothing to do")
                return load_inventory()
            out(f"local cluster is broken ({'; '.join(problems)}); recreating it")
        if state is not None or leftovers():
            _down(state, out=lambda _m: None)
        try:
            return _create(nodes, gpus, fresh_keys, out, idle_stop_s)
        except BaseException:
            out("local.up failed; taking down what was made")
            _down(load_state(), out=lambda _m: None)
            raise


def _create(nodes: int, gpus: int, fresh_keys: bool, out: Out, idle_stop_s: int = 0) -> Inventory:
    t0 = time.monotonic()
    specs = plan(nodes)
    facts = cluster_facts(nodes, gpus, idle_stop_s)
    state = {"nodes": nodes, "gpus": gpus, "fresh_keys": fresh_keys, "idle_stop_s": idle_stop_s, "hosts": [],
             "made_mount_points": [], "started": time.time()}
    layout.STATE.mkdir(parents=True, exist_ok=True)
    save_state(state)  # from here on, `down` knows what to remove
    for mp in layout.MOUNT_POINTS:
        if not mp.exists():
            mp.mkdir(mode=0o755)
            state["made_mount_points"].append(str(mp))
    save_state(state)
    write_files(facts, specs)

    netns.ensure_bridge()
    for s in specs:
        netns.add_host(s.netns, s.index, s.ip)
        state["hosts"].append({"name": s.name, "ip": s.ip, "role": s.role, "index": s.index,
                               "netns": s.netns, "pid": None, "ns": []})
        save_state(state)
    logs = {s.name: layout.host_dir(s.name) / "holder.log" for s in specs}
    procs = {s.name: hosts.start_holder(s.name, netns.netns_path(s.netns), host_mounts(s), logs[s.name])
             for s in specs}
    for entry in state["hosts"]:
        pid = hosts.wait_ready(procs[entry["name"]], entry["name"], logs[entry["name"]])
        entry["pid"], entry["ns"] = pid, sorted(hosts.ns_ids(pid).values())
    save_state(state)
    pids = {e["name"]: e["pid"] for e in state["hosts"]}
    ctl, gpu_specs = specs[0], specs[1:]

    # The same bootstrap scripts as AWS; the controller first (it makes /scratch/logs,
    # which the GPU hosts' scratch step waits for).
    def bootstrap(s: HostSpec) -> None:
        hosts.run(pids[s.name], ["env", f"SLURM_GPU_SKIP_STEPS={' '.join(render.LOCAL_SKIP_STEPS[s.role])}",
                                 "bash", render.BOOTSTRAP_PATH], host=s.name, timeout=120)

    bootstrap(ctl)
    daemons.each(bootstrap, gpu_specs)
    out(f"  {nodes + 1} hosts made and bootstrapped ({time.monotonic() - t0:.1f} s)")

    def base_daemons(s: HostSpec) -> None:
        daemons.hostctl(pids[s.name], s.name, "start", "munge")
        daemons.hostctl(pids[s.name], s.name, "start", "sshd")
        if s.role == "controller":
            daemons.hostctl(pids[s.name], s.name, "start", "slurmctld")

    daemons.each(base_daemons, specs)
    for s in specs:
        daemons.poll(f"munged on {s.name}", lambda p=pids[s.name]: daemons.munge_works(p), 20)
        daemons.poll(f"sshd on {s.name} ({s.ip}:22)", lambda ip=s.ip: daemons.port_open(ip, 22), 20)
    daemons.poll("slurmctld on controller", lambda: daemons.slurmctld_up(pids[ctl.name]), 30, 0.2)
    out(f"  munged, sshd, slurmctld running ({time.monotonic() - t0:.1f} s)")

    inventory = make_inventory(nodes, gpus, idle_stop_s)
    _write(layout.INVENTORY, inventory.to_json() + "\n", 0o600)
    if not fresh_keys:
        # Exactly what `fab train` does on AWS: the controller's key to every node.
        from ops import remote
        from ops.munge import distribute_key

        conns = remote.connect(inventory)
        try:
            sync = distribute_key(conns.controller, conns.nodes, inventory.service_cmd)
        finally:
            conns.close()
        out(f"  munge key installed on {', '.join(sync.installed) or 'no host'} "
            f"({time.monotonic() - t0:.1f} s)")

    if fresh_keys:
        # Configless slurmd fetches its config from slurmctld over munge: with a host's own key
        # it cannot start, as on a fresh AWS node. `fab train` installs the key and starts it.
        out("  GPU hosts keep their own munge keys: slurmd starts once `fab train` installs the key")
    else:
        daemons.each(lambda s: daemons.hostctl(pids[s.name], s.name, "start", "slurmd"), gpu_specs)
        daemons.wait_idle(pids[ctl.name], [s.name for s in gpu_specs], timeout=60)
    out(f"local cluster up: controller + {nodes} GPU hosts x {gpus} GPUs "
        f"in {time.monotonic() - t0:.1f} s; inventory {layout.INVENTORY}")
    return inventory


def make_inventory(nodes: int, gpus: int, idle_stop_s: int = 0) -> Inventory:
    facts = cluster_facts(nodes, gpus, idle_stop_s)
    return from_facts(
        facts, target="local", controller_public_ip=facts.controller.ip,
        # Hosts share this machine's filesystem, so the repo's venv is the nodes' Python.
        python=str(REPO / ".venv" / "bin" / "python"),
        service_cmd=f"{layout.HOSTCTL} {{action}} {{service}}",
        ssh_key_file=str(layout.CLUSTER_KEY),
        extra={**power.inventory_extra(idle_stop_s), "known_hosts": str(layout.KNOWN_HOSTS)},
    )


def load_inventory() -> Inventory:
    return Inventory.from_dict(json.loads(layout.INVENTORY.read_text()))


# ---------------------------------------------------------------- health and status


def _host_entries(state: dict | None) -> list[dict]:
    return list(state.get("hosts", [])) if state else []


def services_of(role: str) -> tuple[str, ...]:
    return ("munge", "sshd", "slurmctld") if role == "controller" else ("munge", "sshd", "slurmd")


def service_running(pid: int, service: str) -> bool:
    r = hosts.run(pid, [str(layout.HOSTCTL), "status", service], check=False, timeout=10)
    return r.returncode == 0


def health(state: dict) -> list[str]:
    """What is wrong with a cluster (empty when every host and daemon is up)."""
    entries = _host_entries(state)
    if len(entries) != state.get("nodes", -1) + 1:
        return ["not every host was made"]
    problems = []
    for e in entries:
        if not e.get("pid") or not hosts.alive(e["pid"]) or \
                sorted(hosts.ns_ids(e["pid"]).values()) != e["ns"]:
            problems.append(f"host {e['name']} is gone")
            continue
        problems += [f"{svc} is not running on {e['name']}" for svc in services_of(e["role"])
                     if not service_running(e["pid"], svc)]
    return problems


def status(out: Out = print) -> bool:
    """Print the hosts and the controller's node table; True when all is up."""
    state = load_state()
    if state is None:
        out("no local cluster (start one with `fab local.up`)")
        return False
    out(f"local cluster: controller + {state['nodes']} GPU hosts x {state['gpus']} GPUs "
        f"(bridge {layout.BRIDGE} {layout.BRIDGE_IP}/{layout.PREFIX_LEN})")
    out(f"{'HOST':<14}{'IP':<15}{'STATE':<7}DAEMONS")
    healthy = True
    ctl_pid = None
    for e in _host_entries(state):
        pid = e.get("pid")
        if pid and hosts.alive(pid) and sorted(hosts.ns_ids(pid).values()) == e["ns"]:
            running = {svc: service_running(pid, svc) for svc in services_of(e["role"])}
            word = "up" if all(running.values()) else "degraded"
            detail = " ".join(f"{svc}:{'up' if ok else 'DOWN'}" for svc, ok in running.items())
            if e["role"] == "controller" and running.get("slurmctld"):
                ctl_pid = pid
        else:
            word, detail = "down", "-"
        healthy &= word == "up"
        out(f"{e['name']:<14}{e['ip']:<15}{word:<7}{detail}")
    if ctl_pid is None:
        out("slurmctld (or the controller) is down: no node table; `fab local.down && fab local.up` "
            "makes the cluster again")
        return False
    try:
        r = hosts.run(ctl_pid, ["sinfo", "-N", "-o", "%14N %10T %16G %5c %8m %P"], check=False,
                      timeout=15)
    except subprocess.TimeoutExpired:
        out("slurmctld does not answer (sinfo timed out after 15 s): no node table; "
            "`fab local.down && fab local.up` makes the cluster again")
        return False
    out("")
    for line in (r.stdout or r.stderr).rstrip().splitlines():
        out(line)
    return healthy and r.returncode == 0


# ---------------------------------------------------------------- down


def leftovers() -> list[str]:
    """What of a local cluster exists on this machine (empty when nothing)."""
    found = [f"namespace {n}" for n in netns.our_netns()]
    found += [f"link {v}" for v in netns.our_veths()]
    if netns.link_exists(layout.BRIDGE):
        found.append(f"bridge {layout.BRIDGE}")
    ns = _all_ns(load_state())
    found += [f"process {p}" for p in hosts.processes_in(ns) if hosts.alive(p)] if ns else []
    return found


def _all_ns(state: dict | None) -> set[str]:
    ns = {i for e in _host_entries(state) for i in e.get("ns", [])}
    for name in netns.our_netns():
        try:
            ns.add(f"net:[{os.stat(netns.netns_path(name)).st_ino}]")
        except OSError:
            pass
    return ns


def down(out: Out = print) -> None:
    """Stop every process of the cluster and remove its namespaces, bridge and runtime files."""
    preflight()
    with op_lock():
        _down(load_state(), out)


def _down(state: dict | None, out: Out) -> None:
    t0 = time.monotonic()
    survivors = hosts.kill_all(_all_ns(state))
    hosts.reap()
    indexes = {e["netns"]: e.get("index") for e in _host_entries(state)}
    for name in set(indexes) | set(netns.our_netns()):
        netns.delete_host(name, indexes.get(name))
    for veth in netns.our_veths():
        netns.ip("link", "del", veth, check=False)
    netns.delete_bridge()
    _unmount_empty_netns_dir()
    for mp in (state or {}).get("made_mount_points", []):
        try:
            Path(mp).rmdir()
        except OSError:
            pass
    for path in (layout.HOSTS_DIR, layout.ETC_SLURM, layout.ETC_SLURM_GPU, layout.BIN_DIR):
        shutil.rmtree(path, ignore_errors=True)
    for path in (layout.INVENTORY, layout.STATE_FILE):
        path.unlink(missing_ok=True)
    left = leftovers() + [f"process {p}" for p in survivors]
    if left:
        raise ClusterError(f"local.down could not remove: {', '.join(left)}")
    out(f"local cluster down ({time.monotonic() - t0:.1f} s); kept {layout.SCRATCH} and {layout.SSH_DIR}")


def _unmount_empty_netns_dir() -> None:
    """`ip netns add` turns /run/netns into a mount point; undo it once no namespace is left."""
    if netns.NETNS_DIR.is_dir() and not any(netns.NETNS_DIR.iterdir()):
        while subprocess.run(["mountpoint", "-q", str(netns.NETNS_DIR)]).returncode == 0:
            if subprocess.run(["umount", str(netns.NETNS_DIR)], capture_output=True).returncode:
                break
