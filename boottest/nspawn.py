"""One boot-test container: systemd as PID 1 under systemd-nspawn, on an overlay over the
cached image (so state survives a reboot inside and the image stays clean), joined to the
boot test's bridge, its console (where cloud-init prints the host keys) in a file.

A wrapper loop restarts nspawn while it exits 133: that is `systemctl reboot` inside. The
wrapper and everything under it live in the container's own cgroups (systemd and unified
hierarchies), so each container's services are its own and teardown can find every
process. Reach inside with `run()` (nsenter into PID 1's namespaces)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from boottest import host, units

CGROUP_ROOTS = (Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"))
CGROUP_PARENT = "slurm-gpu-boot"  # every container's cgroups live under this one
REBOOT_EXIT = 133  # systemd-nspawn's exit status when the container rebooted
INSIDE_ENV = ("env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "LANG=C.UTF-8", "HOME=/root")


@dataclass
class Container:
    name: str  # machine name (the host name the container starts with)
    state: Path  # its overlay upper/work, mount point, console log, wrapper files
    image: Path  # the image's root file system (overlay lower dir, read-only)
    bridge: str
    binds: list[str] = field(default_factory=list)  # --bind=/--bind-ro= arguments
    started: bool = False

    @property
    def root(self) -> Path:
        return self.state / "root"

    @property
    def console(self) -> Path:
        return self.state / "console.log"

    @property
    def pidfile(self) -> Path:
        return self.state / "wrapper.pid"

    def cgroups(self) -> list[Path]:
        return [r / CGROUP_PARENT / self.name for r in CGROUP_ROOTS]

    # ------------------------------------------------------------ lifecycle

    def mount(self) -> None:
        for d in ("upper", "work", "root"):
            (self.state / d).mkdir(parents=True, exist_ok=True)
        if not os.path.ismount(self.root):
            host.run("mount", "-t", "overlay", f"sgpuboot-{self.name}", "-o",
                     f"lowerdir={self.image},upperdir={self.state / 'upper'},workdir={self.state / 'work'}",
                     str(self.root))

    def seed(self, files: dict[str, str | bytes]) -> None:
        """The NoCloud seed (meta-data, user-data, network-config) cloud-init finds at boot."""
        seed = self.root / "var/lib/cloud/seed/nocloud"
        seed.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (seed / name).write_bytes(data if isinstance(data, bytes) else data.encode())
            (seed / name).chmod(0o600)

    def nspawn_argv(self) -> list[str]:
        return ["systemd-nspawn", "-D", str(self.root), "-M", self.name, "-b", "--register=no",
                "--keep-unit", "--console=read-only", "--link-journal=no", f"--network-bridge={self.bridge}",
                *self.binds]

    def start(self) -> None:
        for cg in self.cgroups():
            cg.mkdir(parents=True, exist_ok=True)
        procs = " ".join(shlex.quote(str(cg / "cgroup.procs")) for cg in self.cgroups())
        script = f"""\
for f in {procs}; do echo $$ > "$f"; done
while :; do
  {shlex.join(self.nspawn_argv())} < /dev/null >> {shlex.quote(str(self.console))} 2>&1
  rc=$?
  echo "slurm-gpu-boot: systemd-nspawn exited $rc at $(date -u +%H:%M:%S)" >> {shlex.quote(str(self.console))}
  [ "$rc" -eq {REBOOT_EXIT} ] || break
done
echo "$rc" > {shlex.quote(str(self.state / 'exit'))}
"""
        (self.state / "wrapper.sh").write_text(script)
        (self.state / "exit").unlink(missing_ok=True)
        proc = subprocess.Popen(["bash", str(self.state / "wrapper.sh")],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        self.pidfile.write_text(str(proc.pid))
        self.started = True

    def wrapper_pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text())
        except (FileNotFoundError, ValueError):
            return None
        return pid if Path(f"/proc/{pid}").exists() and _cmdline(pid).find("wrapper.sh") >= 0 else None

    def pid1(self) -> int | None:
        """The host's pid of the container's systemd (None while nspawn is between boots)."""
        wrapper = self.wrapper_pid()
        if wrapper is None:
            return None
        for nspawn in _children(wrapper):
            if _comm(nspawn) == "systemd-nspawn":
                for child in _children(nspawn):
                    if _comm(child) == "systemd":
                        return child
        return None

    def run(self, cmd: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """`cmd` (bash) as root inside the container."""
        pid = self.pid1()
        if pid is None:
            raise host.BootError(f"container {self.name} is not running (console: {self.console})")
        return host.run("nsenter", "-t", str(pid), "-a", *INSIDE_ENV, "bash", "-c", cmd,
                        check=check, timeout=timeout)

    def wait_running(self, timeout: float = 120, settled: bool = False) -> str:
        """Until systemd inside answers (with `settled`: until it finished booting, which is after
        cloud-init's final stage, with no failed unit but units.ALLOWED_FAILED; another failed
        unit raises BootError naming it): its state."""
        deadline = time.monotonic() + timeout
        state = "not started"
        while time.monotonic() < deadline:
            if self.pid1() is not None:
                res = self.run("systemctl is-system-running", check=False, timeout=30)
                state = res.stdout.strip() or res.stderr.strip()
                if state in ("running", "degraded"):
                    if settled:
                        self.check_failed_units()
                    return state
                if not settled and res.stdout.strip():
                    return state
            elif (self.state / "exit").exists():
                raise host.BootError(f"container {self.name} exited ({self.tail()})")
            time.sleep(1)
        raise host.BootError(f"container {self.name} did not finish booting in {timeout:.0f} s "
                             f"(systemd says {state!r}); {self.tail()}")

    def failed_units(self) -> list[str]:
        return units.parse_failed(self.run(units.FAILED_CMD, check=False, timeout=30).stdout)

    def check_failed_units(self) -> None:
        """Raise BootError naming every failed unit not in units.ALLOWED_FAILED, with its log."""
        bad = units.not_allowed(self.failed_units())
        if bad:
            logs = "\n".join(self.run(f"journalctl -b -u {shlex.quote(u)} --no-pager -n 8 -o cat", check=False,
                                       timeout=30).stdout.rstrip() for u in bad)
            raise host.BootError(f"container {self.name}: failed unit(s) {', '.join(bad)} (only "
                                 f"{', '.join(units.ALLOWED_FAILED)} may fail in a container); their "
                                 f"last log lines:\n{logs}")

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.console.read_text(errors="replace").splitlines()[-lines:]
        except FileNotFoundError:
            return "no console output"
        return "last console lines:\n" + "\n".join(f"  | {ln}" for ln in text)

    def stop(self, timeout: float = 60) -> None:
        """Power off inside, then wait; SIGTERM to nspawn (an orderly stop), then SIGKILL to
        every process left in the container's cgroups."""
        wrapper = self.wrapper_pid()
        if wrapper is not None:
            # The loop must not restart it.
            (self.state / "wrapper.sh").write_text("exit 0\n")
            if self.pid1() is not None:
                try:
                    self.run("systemctl poweroff --no-block", check=False, timeout=15)
                except (host.BootError, subprocess.TimeoutExpired):
                    pass
            if not _wait_gone(wrapper, timeout):
                for pid in _children(wrapper):
                    _signal(pid, signal.SIGTERM)
                if not _wait_gone(wrapper, 15):
                    self.kill_all()
                    _signal(wrapper, signal.SIGKILL)
                    _wait_gone(wrapper, 10)
        self.kill_all()

    def kill_all(self) -> None:
        for _ in range(10):
            pids = [p for cg in self.cgroups() for p in _cgroup_procs(cg)]
            if not pids:
                return
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            time.sleep(0.5)

    def unmount(self) -> None:
        if os.path.ismount(self.root):
            host.run("umount", "-R", str(self.root), check=False)
            if os.path.ismount(self.root):
                host.run("umount", "-l", str(self.root), check=False)

    def remove_cgroups(self) -> None:
        for cg in self.cgroups():
            remove_cgroup_tree(cg)


def remove_cgroup_tree(cg: Path) -> None:
    if not cg.exists():
        return
    for sub in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            sub.rmdir()
        except OSError:
            pass
    try:
        cg.rmdir()
    except OSError:
        pass


def _cgroup_procs(cg: Path) -> list[int]:
    pids = []
    if not cg.exists():
        return pids
    for f in cg.rglob("cgroup.procs"):
        try:
            pids += [int(x) for x in f.read_text().split()]
        except OSError:
            pass
    try:
        pids += [int(x) for x in (cg / "cgroup.procs").read_text().split()]
    except OSError:
        pass
    return sorted(set(pids))


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        try:  # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.3)
    return not Path(f"/proc/{pid}").exists()
