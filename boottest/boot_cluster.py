"""The boot test's cluster: the controller and two GPU nodes of a boot platform, each a
container booted from the platform's image with the user-data the stack renders for its
role (bootstrap/user_data.py `user_data_gzip`, the bytes infra/program.py gives EC2), and the
inventory `fab --target boot` reaches them with.

`BootCluster(platform).up()` builds (or reuses) the image, apt repository and wheelhouse,
makes the bridge, seeds and starts the containers; `wait_cloud_init()` waits for every host's
first boot; `down()` (also on failure and Ctrl-C, see teardown.py) leaves nothing behind.
Each phase's wall time is in `timings`."""

from __future__ import annotations

import calendar
import json
import os
import shlex
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bootstrap.node_layout import STEPS, STEPS_DIR, TRAINING_PYTHON
from bootstrap.user_data import user_data_gzip
from boottest import aptlock, aptrepo, host, images, net, nspawn, wheelhouse
from cluster.facts import ClusterFacts, NodeShape, plan_hosts, this_machine_topology
from cluster.inventory import Inventory
from cluster.platform import Platform
from cluster.spec import Access
from cluster.targets import boot as boot_target
from ops.actions import cloudinit
from ops.ssh import hostkeys

STATE_ROOT, INVENTORY = boot_target.STATE_ROOT, boot_target.BOOT_INVENTORY
CLUSTER_NAME = "boot"
GPUS_PER_NODE = 2
GPU_TYPE = "l4"
NODES = 2
SCRATCH_SHARE = "/srv/cluster-scratch"  # where a GPU node sees the shared scratch (platform fact)
SERVICE_CMD = "sudo systemctl {action} {service}"  # as on AWS (infra/cluster_component.py)
NVIDIA_MAJOR = 195
# GPU nodes render as spot nodes, so their interruption watcher runs under systemd; it asks each
# container's own loopback (nothing listens there: it keeps retrying), never a real metadata service.
SPOT_IMDS = "http://127.0.0.1:18169"


def machine_shape() -> NodeShape:
    """What each container reports to slurmd: this machine's CPUs and their topology, memory a
    little under it."""
    mem_kib = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                   if ln.startswith("MemTotal:"))
    cpus, sockets, threads = this_machine_topology()
    return NodeShape(cpus=cpus, real_memory_mib=int(mem_kib / 1024 * 0.5), gpu_count=GPUS_PER_NODE,
                     gpu_type=GPU_TYPE, sockets=sockets, threads_per_core=threads)


def cluster_facts(platform: Platform) -> ClusterFacts:
    ctl, nodes = plan_hosts(net.SUBNET, NODES)
    return ClusterFacts(cluster_name=CLUSTER_NAME, controller=ctl, gpu_nodes=nodes, shape=machine_shape(),
                        subnet_cidr=net.SUBNET, ssh_user="ubuntu", platform=platform, efa=False,
                        spot=True, spot_imds=SPOT_IMDS)


def ec2_style_name(ip: str) -> str:
    """The name an instance boots with before the bootstrap's hostname step renames it."""
    return "ip-" + ip.replace(".", "-")


@dataclass
class BootCluster:
    platform: Platform
    state: Path = STATE_ROOT / "run"
    timings: dict[str, object] = field(default_factory=dict)
    containers: dict[str, nspawn.Container] = field(default_factory=dict)
    apt_lock: aptlock.AptLockHolder | None = None

    def __post_init__(self) -> None:
        self.facts = cluster_facts(self.platform)
        self.roles = {self.facts.controller.name: "controller", **{h.name: "gpu" for h in self.facts.gpu_nodes}}
        self.ips = {h.name: h.ip for h in self.facts.hosts}

    @contextmanager
    def phase(self, name: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.timings[name] = round(self.timings.get(name, 0.0) + time.monotonic() - t0, 1)

    @property
    def apt_lock_node(self) -> str:
        return self.facts.gpu_nodes[-1].name

    @property
    def key_file(self) -> Path:
        return self.state / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.state / "known_hosts"

    @property
    def scratch(self) -> Path:
        return self.state / "scratch"

    # ------------------------------------------------------------ build and boot

    def build(self) -> None:
        with self.phase("image"):
            self.image, built = images.image(self.platform, self.facts.ssh_user)
            self.timings["image_built"] = built
        with self.phase("apt_repo"):
            self.repo, built = aptrepo.repo(self.platform, self.image)
            self.timings["apt_repo_built"] = built
        with self.phase("wheelhouse"):
            self.wheels, built = wheelhouse.wheelhouse(self.platform, self.repo)
            self.timings["wheelhouse_built"] = built

    def up(self) -> None:
        self.build()
        with self.phase("boot"):
            if self.state.exists():
                shutil.rmtree(self.state)
            self.state.mkdir(parents=True)
            self.scratch.mkdir()
            host.run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "slurm-gpu-boot", "-f", str(self.key_file))
            net.up()
            for name, role in self.roles.items():
                self.containers[name] = self._container(name, role)
            # Another apt holds the dpkg lock on the last GPU node as it boots, longer than
            # cloud-init would wait for it (boottest/aptlock.py): its first boot must still end clean.
            self.apt_lock = aptlock.AptLockHolder(self.containers[self.apt_lock_node].root)
            self.apt_lock.hold()
            for c in self.containers.values():
                c.start()
            for c in self.containers.values():
                c.wait_running()
        self.write_inventory()

    def _container(self, name: str, role: str) -> nspawn.Container:
        ip = self.ips[name]
        state = self.state / name
        binds = [aptrepo.bind_arg(self.repo), wheelhouse.bind_arg(self.wheels)]
        if role == "controller":
            # The controller's /scratch is its own disk on AWS; here it is the shared directory.
            binds.append(f"--bind={self.scratch}:{self.facts.scratch}")
        else:
            binds.append(f"--bind={self.scratch}:{SCRATCH_SHARE}")
            devdir = state / "dev"
            devdir.mkdir(parents=True)
            for i in range(self.facts.shape.gpu_count):
                dev = devdir / f"nvidia{i}"
                os.mknod(dev, 0o666 | 0o020000, os.makedev(NVIDIA_MAJOR, i))
                binds.append(f"--bind={dev}:/dev/nvidia{i}")
        c = nspawn.Container(ec2_style_name(ip), state, self.image, net.BRIDGE, binds)
        c.mount()
        hostname = None if role == "controller" else name
        pub = self.key_file.with_suffix(".pub").read_text().strip()
        c.seed({
            "meta-data": json.dumps({"instance-id": f"i-boot-{name}", "local-hostname": ec2_style_name(ip),
                                     "public-keys": [pub]}, indent=1) + "\n",
            # The bytes EC2 would hand the node: gzip, which cloud-init unpacks itself.
            "user-data": user_data_gzip(self.facts, role, hostname),
            "network-config": (f"version: 2\nethernets:\n  host0:\n    addresses: [{ip}/{net.PREFIX}]\n"),
        })
        return c

    # ------------------------------------------------------------ first boot

    def cloud_init_status(self, name: str) -> dict:
        res = self.containers[name].run("cloud-init status --format json", check=False, timeout=60)
        try:
            return cloudinit.without_uptime_times(json.loads(res.stdout))
        except json.JSONDecodeError:
            return {"status": "unreadable", "errors": [res.stdout[-300:], res.stderr[-300:]]}

    def wait_cloud_init(self, timeout: float = 1500) -> dict[str, dict]:
        """Every host's final `cloud-init status` (done or error), once none is running."""
        started = time.time()
        with self.phase("cloud_init"):
            deadline = time.monotonic() + timeout
            final: dict[str, dict] = {}
            while time.monotonic() < deadline and len(final) < len(self.containers):
                for name in self.containers:
                    if name not in final:
                        st = self.cloud_init_status(name)
                        if st.get("status") in ("done", "error", "degraded done", "disabled"):
                            final[name] = st
                time.sleep(3)
            for name in self.containers:
                final.setdefault(name, {"status": "timeout", "errors": [f"still running after {timeout:.0f} s"]})
        self.pin_host_keys()
        self.timings["steps"] = {name: self.step_seconds(name, started) for name in self.containers}
        return final

    def step_seconds(self, name: str, started: float) -> dict[str, float]:
        """Seconds each bootstrap step took on a host, from the end times its status lines hold
        (whole seconds): the first step counts from when the wait began, so it includes cloud-init's
        own modules before the bootstrap. Where a first boot's minutes go, per role."""
        order = STEPS[self.roles[name]]
        ends = []
        for step, status in self.steps(name).items():
            parts = status.split()
            if len(parts) >= 2 and parts[0] == "ok":
                try:
                    end = calendar.timegm(time.strptime(parts[1], "%Y-%m-%dT%H:%M:%SZ"))
                except ValueError:
                    continue
                ends.append((end, order.index(step) if step in order else len(order), step))
        out, prev = {}, started
        for end, _, step in sorted(ends):  # ties (whole seconds) in the script's order
            out[step] = round(max(0.0, end - prev), 1)
            prev = end
        return out

    def steps(self, name: str) -> dict[str, str]:
        """The bootstrap's per-step record on a host: step -> its status line."""
        out = self.containers[name].run(cloudinit.STEPS_CMD, check=False).stdout
        return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)

    def step_log(self, name: str, step: str, lines: int = 25) -> str:
        log = shlex.quote(f"{STEPS_DIR}/{step}.log")
        return self.containers[name].run(f"tail -n {int(lines)} {log}", check=False).stdout

    def pin_host_keys(self) -> None:
        """known_hosts from the keys cloud-init printed on each console (as fab reads EC2's)."""
        entries = []
        for name, c in self.containers.items():
            try:
                keys = hostkeys.parse_console_output(c.console.read_text(errors="replace"))
            except (hostkeys.HostKeyError, FileNotFoundError):
                continue
            entries.append(((name, self.ips[name]), [f"{t} {b}" for t, b in keys]))
        hostkeys.write_known_hosts(self.known_hosts, entries)

    # ------------------------------------------------------------ fab's view

    def inventory(self) -> Inventory:
        """The cluster spec of the containers (its facts carry the platform), written as BOOT_INVENTORY."""
        return Inventory(target="boot", facts=self.facts, access=Access(
            controller_public_ip=self.facts.controller.ip, python=TRAINING_PYTHON, service_cmd=SERVICE_CMD,
            ssh_key_file=str(self.key_file), known_hosts=str(self.known_hosts)))

    def write_inventory(self) -> None:
        INVENTORY.parent.mkdir(parents=True, exist_ok=True)
        INVENTORY.write_text(self.inventory().to_json())

    # ------------------------------------------------------------ teardown

    def down(self) -> None:
        from boottest import teardown

        with self.phase("teardown"):
            if self.apt_lock is not None:
                self.apt_lock.release()
                self.timings["apt_lock_held"] = self.apt_lock.held_s
            teardown.everything(self.state)
