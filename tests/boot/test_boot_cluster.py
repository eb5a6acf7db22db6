"""The boot test: every role booted for real from the stack's rendered user-data.

For each boot platform (Debian 12: Slurm 22.05; Debian 13: Slurm 24.11, bracketing the AMI's
23.11) the controller and two GPU nodes boot as systemd-nspawn containers (systemd PID 1),
cloud-init NoCloud runs the user-data `pulumi up` would give them, packages come from a local
apt repository and the training pins from a local wheelhouse (CPU torch; on Debian 13 Debian's
own python3-torch, see cluster/platform.py). Then the product's own path: `fab train --target
boot` (cloud-init wait, munge key sync, reconfigure, sanity job, tiny-model fine-tune on CPU,
adapters home), the Slurm state fab leaves, and a GPU node's reboot. Everything is torn down after (checked). docs/BOOTTEST.md says what stands in for what.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from bootstrap.node_layout import SPOT_WATCH_UNIT, STEPS
from cluster.targets.boot import BOOT

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
LOCK = "/tmp/sgpu-boottest.lock"
TIMINGS = Path(os.environ.get("SLURM_GPU_BOOT_TIMINGS", "/var/cache/slurm-gpu-boot/timings.json"))

pytestmark = [pytest.mark.boot, pytest.mark.slow]

# Debian 12 trains on the pinned torch's CPU wheel; Debian 13 on Debian's python3-torch 2.6.0
# (Platform.os_torch: this machine's index has no CPU torch of the pin for cp313).
BOOT_PLATFORMS = BOOT.platforms
# How long cloud-init's apt package manager waits for the dpkg locks before it fails the module
# (APT_LOCK_WAIT_TIMEOUT: cloudinit/distros/debian.py in 22.4, .../package_management/apt.py in 25.1).
CLOUD_INIT_APT_LOCK_WAIT_S = 30


@pytest.fixture(scope="module", params=BOOT_PLATFORMS, ids=lambda p: p.name)
def booted(request):
    from boottest import boot_cluster as cluster
    from boottest import teardown

    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        teardown.everything()  # what a killed run left
        bc = cluster.BootCluster(request.param)
        try:
            bc.up()
            bc.final = bc.wait_cloud_init()
            yield bc
        finally:
            bc.down()
            _record(bc)
            left = teardown.leftovers()
        assert not left, f"the boot test left {left}"


def _record(bc) -> None:
    try:
        data = json.loads(TIMINGS.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        data = {}
    data[bc.platform.name] = {**bc.timings, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    TIMINGS.parent.mkdir(parents=True, exist_ok=True)
    TIMINGS.write_text(json.dumps(data, indent=1) + "\n")


def _roles(bc):
    return bc.roles.items()


def test_cloud_init_done_and_every_step_ok(booted):
    bc = booted
    for name, role in _roles(bc):
        status = bc.final[name]
        steps = bc.steps(name)
        not_ok = {s: steps.get(s, "missing") for s in STEPS[role] if not steps.get(s, "").startswith("ok")}
        # A failed step is what ended cloud-init in error: name it, with the end of its log.
        failed = f"bootstrap steps not ok: {not_ok}\n" + "\n".join(
            f"--- {s}.log\n{bc.step_log(name, s)}" for s in not_ok if not_ok[s] != "missing")
        assert status.get("status") == "done" and not status.get("errors"), (
            f"{name}: cloud-init {status}\n{failed}\n"
            f"{bc.containers[name].run('tail -n 30 /var/log/cloud-init-output.log', check=False).stdout}")
        assert not not_ok, f"{name}: {failed}"
        # Debian 13's cloud-init 25.1 prints seconds since boot as a 1970 date: left out, not shown.
        assert " 1970 " not in status.get("last_update", ""), f"{name}: {status}"


def test_every_host_settled_with_no_failed_unit_but_those_a_container_cannot_run(booted):
    """systemd finished booting on every host and no unit failed but boottest.units.ALLOWED_FAILED
    (`wait_running(settled=True)` raises naming any other, with its log)."""
    from boottest import units

    for name, c in booted.containers.items():
        c.wait_running(timeout=120, settled=True)
        assert not units.not_allowed(c.failed_units()), name


def test_first_boot_waits_out_another_apt(booted):
    """The harness held one GPU node's dpkg frontend lock from before it booted until its
    `packages` step had waited on it (boottest/aptlock.py), longer than cloud-init's own package
    module waits (30 s, then it fails the boot). The node's first boot still ends clean: the
    packages are installed by the bootstrap, whose apt waits (DPkg::Lock::Timeout)."""
    bc = booted
    name, holder = bc.apt_lock_node, bc.apt_lock
    assert holder is not None and holder.released, "the apt lock holder never let go"
    assert holder.held_s > CLOUD_INIT_APT_LOCK_WAIT_S, f"the lock was held only {holder.held_s} s"
    assert holder.saw_step_waiting, f"{name}: its packages step never ran while the lock was held"
    status = bc.final[name]
    assert status.get("status") == "done" and not status.get("errors"), (
        f"{name}: cloud-init {status} after another apt held the dpkg lock for {holder.held_s} s\n"
        + bc.containers[name].run("grep -iE 'apt lock|Traceback|Error' /var/log/cloud-init.log | tail -n 15",
                                  check=False).stdout)
    steps = bc.steps(name)
    assert all(steps.get(s, "").startswith("ok") for s in STEPS["gpu"]), steps


def test_gpu_nodes_installed_the_training_stack_from_the_controllers_cache(booted):
    """The controller's `wheels` step filled the wheel cache on the shared scratch (from the image's
    pip index: the wheelhouse, standing in for PyPI); every GPU node's `training` step installed from
    that cache alone (--no-index, no pip.conf), not from the index. A platform whose torch is the
    OS's package (Platform.os_torch) has no cache: its nodes say so and install from the index."""
    from bootstrap.node_layout import STATE_DIR

    bc = booted
    ctl_log = bc.step_log(bc.facts.controller.name, "wheels")
    os_torch = bc.platform.os_torch
    if os_torch:
        assert f"no wheel cache: the GPU nodes' torch is the OS's {os_torch.package}" in ctl_log, ctl_log
    else:
        m = re.search(r"wheel cache (\S+): \d+ MB in \d+ s", ctl_log)
        assert m, ctl_log
        cache = m[1]
    for h in bc.facts.gpu_nodes:
        log = bc.step_log(h.name, "training", 400)
        source = bc.containers[h.name].run(f"cat {STATE_DIR}/training-source", check=False).stdout
        if os_torch:
            assert source.startswith("index ") and f"torch is the OS's {os_torch.package}" in source, (
                f"{h.name}: {source}\n{log}")
            continue
        assert source.startswith(f"cache {cache} "), f"{h.name}: {source}\n{log}"
        assert f"training stack from the controller's wheel cache {cache}" in log
        assert f"Looking in links: {cache}" in log and "/srv/slurm-gpu-wheels" not in log, log


def test_daemons_after_first_boot(booted):
    """slurmctld and munge run under systemd; no GPU node's slurmd is failed (before fab's key
    sync it may wait for the cluster's key, but a failed unit is a broken first boot)."""
    bc = booted
    ctl = bc.containers[bc.facts.controller.name]
    assert ctl.run("systemctl is-active slurmctld munge", check=False).stdout.split() == ["active", "active"]
    for h in bc.facts.gpu_nodes:
        c = bc.containers[h.name]
        assert c.run("systemctl is-active munge", check=False).stdout.strip() == "active"
        # Spot renders (boottest/boot_cluster.py): the interruption watcher runs on every GPU node.
        from boottest.boot_cluster import SPOT_IMDS

        watch = c.run(f"systemctl is-active {SPOT_WATCH_UNIT}", check=False).stdout.strip()
        assert watch == "active", f"{h.name}: {SPOT_WATCH_UNIT} is {watch}:\n" + c.run(
            f"journalctl -u {SPOT_WATCH_UNIT} --no-pager -n 15", check=False).stdout
        assert f"watching {SPOT_IMDS} every" in c.run(f"journalctl -u {SPOT_WATCH_UNIT} --no-pager",
                                                      check=False).stdout
        state = c.run("systemctl is-failed slurmd", check=False).stdout.strip()
        assert state != "failed", f"{h.name}: slurmd failed at first boot:\n" + c.run(
            "journalctl -u slurmd --no-pager -n 15; tail -n 15 /var/log/slurm/slurmd.log", check=False).stdout


def test_host_keys_pinned_from_consoles(booted):
    from ops.ssh import hostkeys

    pins = hostkeys.read_known_hosts(booted.known_hosts)
    for name in booted.roles:
        assert pins.get(name), f"{name}: no host key on its console ({booted.containers[name].console})"
        # The console holds the bootstrap's own lines but none of its steps' output (apt, pip, files from
        # /scratch), which cloud-init's output setting keeps in /var/log/cloud-init-output.log: text that
        # is not ours never reaches where the keys are pinned from.
        console = set(booted.containers[name].console.read_text(errors="replace").splitlines())
        out = booted.containers[name].run("cat /var/log/cloud-init-output.log", check=False).stdout.splitlines()
        ours = [ln for ln in out if ln.startswith("slurm-gpu-bootstrap(")]
        theirs = [ln for ln in out if len(ln) > 20 and not ln.startswith("slurm-gpu-bootstrap(")
                  # the key block (every key the host has: Debian 12 still makes ssh-dss) is ours too
                  and "SSH HOST KEY" not in ln and not ln.startswith(("ssh-", "ecdsa-", "ec2:"))
                  and "SHA256:" not in ln]
        assert ours and theirs, f"{name}: cloud-init-output.log lacks the bootstrap's lines or its steps' output"
        assert any(ln in console for ln in ours), f"{name}: the bootstrap's own lines are not on the console"
        leaked = [ln for ln in theirs if ln in console]
        assert not leaked, f"{name}: step output on the console: {leaked[:3]}"


def fab(bc, *args, timeout=1200):
    env = {**os.environ, "SLURM_GPU_RUNS": str(bc.state / "runs")}
    res = subprocess.run([FAB, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stdout + res.stderr


def test_fab_train_reaches_adapters(booted):
    bc = booted
    with bc.phase("fab_train"):
        rc, out = fab(bc, "train", "--target", "boot")
    assert rc == 0, out
    # The network check ran and passed (on Debian 13's torch, without libuv, through the file rendezvous)
    assert re.search(r"network check: 2 node\(s\), [\d.]+ s", out) and "all nodes pass" in out, out
    assert re.search(r"\[1/7\] cloud-init: .*", out), out
    assert "gpu-node-01" in out and "gpu-node-02" in out
    m = re.search(r"submitted job (\d+)", out)
    assert m, out
    run = bc.state / "runs" / m[1]
    for name in ("adapter_model.safetensors", "adapter_config.json", "trainer_state.json"):
        assert (run / name).is_file(), f"{name} not brought home:\n{out}"


# What a job tries on its GPU node: each line it prints is something it must not have been able to do,
# but the last (who it is).
JOB_PROBE = """sudo -n true 2>/dev/null && echo BECAME-ROOT
cat /etc/munge/munge.key >/dev/null 2>&1 && echo READ-MUNGE-KEY
touch {job_dir}/training/planted.py 2>/dev/null && echo CHANGED-THE-CODE
mv {job_dir}/config.yaml {job_dir}/work/ 2>/dev/null && echo MOVED-THE-CONFIG
touch {scratch}/planted 2>/dev/null && echo WROTE-SCRATCH-ROOT
id -un"""


def test_jobs_run_as_their_own_user_who_cannot_become_root_or_change_what_they_run(booted):
    """`fab train`'s job ran as the jobs' user (its output is that user's; the code, config and script
    the admin's), which every host made with the same uid and no sudo. A job of that user, submitted
    as fab submits one, can neither become root on its node (and so read the munge key and speak to
    Slurm as anyone), nor change the staged code or config, nor write in /scratch's root."""
    bc = booted
    user, uid, scratch, admin = bc.facts.job_user, bc.facts.job_uid, bc.facts.scratch, bc.facts.ssh_user
    assert user not in ("root", admin)
    for name, c in bc.containers.items():
        assert c.run(f"id -u {user}").stdout.strip() == str(uid), name
        assert "is not allowed to run sudo" in c.run(f"sudo -n -l -U {user}", check=False).stdout, name
    ctl = bc.containers[bc.facts.controller.name]
    job_dir = ctl.run(f"ls -1dt {scratch}/slurm-gpu/jobs/* | head -1", check=False).stdout.strip()
    assert job_dir, "no job folder: fab train did not stage a job"
    owners = dict(reversed(line.split(" ", 1)) for line in ctl.run(
        f"cd {job_dir} && stat -c '%U %n' . config.yaml finetune.sbatch training training/train.py work output "
        "output/adapter_config.json").stdout.splitlines())
    assert owners == {".": admin, "config.yaml": admin, "finetune.sbatch": admin, "training": admin,
                      "training/train.py": admin, "work": user, "output": user, "output/adapter_config.json": user}, owners
    probe = JOB_PROBE.format(job_dir=job_dir, scratch=scratch)
    job = ctl.run(f"runuser -u {user} -- sbatch --parsable -N1 -w {bc.facts.gpu_nodes[0].name} --chdir=/ "
                  f"-o {scratch}/logs/probe-%j.out --wrap {shlex.quote(probe)}").stdout.strip()
    deadline = time.monotonic() + 120
    while ctl.run(f"squeue -h -j {job}", check=False).stdout.strip() and time.monotonic() < deadline:
        time.sleep(1)
    out = ctl.run(f"cat {scratch}/logs/probe-{job}.out", check=False).stdout.split()
    assert out == [user], out


def _age_s(c) -> float:
    """How long the container's systemd (PID 1) has run, from this machine's /proc."""
    ticks = int(Path(f"/proc/{c.pid1()}/stat").read_text().rsplit(")", 1)[1].split()[19])
    return float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")


def _shown_s(text: str) -> int:
    """`fab status`'s "up 1 h 5 min" -> 3900 (the lower bound it stands for)."""
    unit = {"s": 1, "min": 60, "h": 3600, "d": 86400}
    return sum(int(n) * unit[u] for n, u in re.findall(r"(\d+) (s|min|h|d)\b", text))


def test_fab_status_shows_how_long_each_host_has_run_not_the_machines_uptime(booted):
    """A container shares this machine's kernel, so `uptime` there is the machine's; fab status
    shows how long the host's own systemd has run."""
    bc = booted
    rc, out = fab(bc, "status", "--target", "boot", timeout=120)
    assert rc == 0, out
    for h in bc.facts.hosts:
        m = re.search(rf"^\s+{h.name}\s+\S+\s+{re.escape(h.ip)}\s.*?\b(up\b.*)$", out, re.M)
        assert m, out
        shown, age = _shown_s(m[1]), _age_s(bc.containers[h.name])
        assert m[1] != "up" and shown <= age + 5 < shown + 65, f"{h.name}: {m[1]!r}, its systemd has run {age:.0f} s"


def _sinfo(bc) -> dict[str, tuple[str, str]]:
    ctl = bc.containers[bc.facts.controller.name]
    out = ctl.run("sinfo -N -h -o '%N %t %G'", check=False).stdout
    return {p[0]: (p[1], p[2]) for p in (ln.split() for ln in out.splitlines()) if len(p) == 3}


def test_slurm_nodes_idle_with_gres(booted):
    bc = booted
    want_gres = f"gpu:{bc.facts.shape.gpu_type}:{bc.facts.shape.gpu_count}"
    nodes = _sinfo(bc)
    for h in bc.facts.gpu_nodes:
        assert bc.containers[h.name].run("systemctl is-active slurmd", check=False).stdout.strip() == "active"
        assert nodes.get(h.name, ("missing", ""))[0] == "idle", nodes
        assert nodes[h.name][1].startswith(want_gres), nodes


KEY = "/etc/munge/munge.key"


def test_a_controller_key_its_munged_does_not_use_changes_no_node(booted):
    """The controller's key file replaced by 1024 random bytes (a valid-looking key its running
    munged does not use): `fab train` refuses at the key step naming `controller` and the fix, and
    every GPU node keeps its working key."""
    bc = booted
    ctl = bc.containers[bc.facts.controller.name]

    def digests() -> dict[str, str]:
        return {n: bc.containers[n].run(f"sha256sum {KEY}").stdout.split()[0] for n in bc.roles}

    good = digests()
    assert len(set(good.values())) == 1, good
    ctl.run(f"cp -p {KEY} {KEY}.good && head -c 1024 /dev/urandom > {KEY}.bad && "
            f"install -o munge -g munge -m 0400 {KEY}.bad {KEY} && rm {KEY}.bad")
    try:
        with bc.phase("bad_controller_key"):
            rc, out = fab(bc, "train", "--target", "boot", timeout=300)
    finally:
        ctl.run(f"mv -f {KEY}.good {KEY}")
        now = digests()
        for n in (n for n in bc.roles if now[n] != good[n]):  # the code before the check copied it
            (bc.containers[n].root / KEY.lstrip("/")).write_bytes((ctl.root / KEY.lstrip("/")).read_bytes())
            bc.containers[n].run("systemctl restart munge")
    assert now == good, f"a node's key changed:\n{out}"
    assert rc == 1, out
    assert "munge key failed on controller:" in out and "is not the key its running munged uses" in out, out
    assert "no node was changed" in out and "restart munge there (`sudo systemctl restart munge`)" in out, out
    assert bc.facts.controller.ip not in out and "[3/7]" not in out and "Traceback" not in out, out
    assert ctl.run("ls -d /tmp/slurm-gpu-munge-probe.* 2>/dev/null || true").stdout == "", "the check left a directory"


def test_gpu_node_reboot_comes_back_idle(booted):
    """`systemctl reboot` inside (nspawn exits 133, the wrapper boots it again): the node returns
    idle with no manual step, /scratch mounted before slurmd started."""
    bc = booted
    name = bc.facts.gpu_nodes[0].name
    c = bc.containers[name]
    with bc.phase("reboot"):
        old = c.pid1()
        c.run("systemctl reboot --no-block", check=False)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and (c.pid1() in (None, old)):
            time.sleep(1)
        assert c.pid1() not in (None, old), f"{name} did not boot again; {c.tail()}"
        c.wait_running(timeout=180, settled=True)
        state = ""
        while time.monotonic() < deadline:
            state = _sinfo(bc).get(name, ("missing", ""))[0]
            if state == "idle":
                break
            time.sleep(2)
    assert state == "idle", f"{name} is {state!r} after its reboot"
    assert "exited 133" in c.console.read_text(errors="replace")
    mounted = c.run("findmnt -n -o TARGET /scratch", check=False).stdout.strip()
    assert mounted == "/scratch"
    # systemd's own record of this boot: the mount unit became active before slurmd started.
    times = c.run("systemctl show -p ActiveEnterTimestampMonotonic --value scratch.mount; "
                  "systemctl show -p ExecMainStartTimestampMonotonic --value slurmd.service").stdout.split()
    assert len(times) == 2 and 0 < int(times[0]) <= int(times[1]), times


def test_a_failed_unit_of_ours_keeps_a_host_unsettled(booted):
    """A unit of ours that failed (here a transient one that exits 1) makes the host not settled,
    and the harness names it: "degraded" alone is no longer enough."""
    from boottest import host

    c = booted.containers[booted.facts.gpu_nodes[-1].name]
    c.run("systemd-run --unit=slurm-gpu-canary -p Type=oneshot false", check=False)
    try:
        assert c.run("systemctl is-failed slurm-gpu-canary.service", check=False).stdout.strip() == "failed"
        with pytest.raises(host.BootError, match=r"failed unit\(s\) slurm-gpu-canary\.service"):
            c.wait_running(timeout=60, settled=True)
    finally:
        c.run("systemctl reset-failed slurm-gpu-canary.service", check=False)
    c.wait_running(timeout=60, settled=True)


# The controller's metadata guard (its `imds` step), against the stand-in metadata service on the
# controller container's own loopback at the address the cluster renders for it (SPOT_IMDS): the
# requests botocore makes for an instance role's credentials (IMDSv2 token, role name, credentials).
GUARD_PROBE = r"""
import json, sys, urllib.request as u
base = sys.argv[1]
try:
    token = u.urlopen(u.Request(f"{base}/latest/api/token", method="PUT",
                                headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}), timeout=5).read().decode()
    get = lambda p: u.urlopen(u.Request(base + p, headers={"X-aws-ec2-metadata-token": token}), timeout=5).read().decode()
    role = get("/latest/meta-data/iam/security-credentials/")
    print(json.loads(get(f"/latest/meta-data/iam/security-credentials/{role}"))["AccessKeyId"])
except OSError as e:
    print(f"refused: {type(e).__name__}")
"""
GUARD_KEY = "ASIABOOTTESTSTANDIN0"


def _metadata_as_each_user(bc) -> dict[str, str]:
    """root, slurm (SlurmUser: the power programs), the admin's SSH user and the jobs' user ask the controller's
    metadata stand-in for the role's credentials: user -> the key, or how it was refused."""
    from boottest.boot_cluster import SPOT_IMDS

    c = bc.containers[bc.facts.controller.name]
    port = SPOT_IMDS.rsplit(":", 1)[1]
    (c.root / "root/imds_standin.py").write_text((REPO / "tests" / "support" / "imds_standin.py").read_text())
    (c.root / "usr/local/lib/guard_probe.py").write_text(GUARD_PROBE)  # readable by every user
    (c.root / "root/imds.json").write_text(json.dumps({"credentials": {
        "role": "slurm-gpu-power", "AccessKeyId": GUARD_KEY, "SecretAccessKey": "x" * 40, "Token": "t",
        "Expiration": "2099-01-01T00:00:00Z"}}))
    c.run(f"nohup python3 /root/imds_standin.py {port} /root/imds.json >/dev/null 2>&1 & echo $! > /root/imds.pid; "
          f"for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && break; sleep 0.1; done")
    try:
        return {user: c.run(f"setpriv --reuid={user} --regid={user} --init-groups python3 "
                            f"/usr/local/lib/guard_probe.py {SPOT_IMDS}", check=False).stdout.strip()
                for user in ("root", "slurm", bc.facts.ssh_user, bc.facts.job_user)}
    finally:
        c.run("kill $(cat /root/imds.pid)", check=False)


def test_only_root_and_slurm_reach_the_controllers_metadata(booted):
    """Booted for real: the guard's unit loaded the rules at boot (nftables in the container's own
    network namespace); the admin's SSH user and the jobs' user are refused; the power programs' user gets
    the role."""
    from bootstrap.node_layout import IMDS_GUARD_UNIT

    bc = booted
    c = bc.containers[bc.facts.controller.name]
    assert c.run(f"systemctl is-enabled {IMDS_GUARD_UNIT}; systemctl is-active {IMDS_GUARD_UNIT}",
                 check=False).stdout.split() == ["enabled", "active"]
    # Fails closed: the running slurmctld requires the guard (its drop-in).
    assert IMDS_GUARD_UNIT in c.run("systemctl show -p Requires --value slurmctld", check=False).stdout.split()
    got = _metadata_as_each_user(bc)
    assert got["root"] == GUARD_KEY and got["slurm"] == GUARD_KEY, got
    assert got[bc.facts.ssh_user].startswith("refused: ") and got[bc.facts.job_user].startswith("refused: "), got


def test_wheel_cache_is_roots_alone_and_a_node_user_cannot_move_it(booted):
    """The cache the controller built for real: /scratch root's and sticky, the cache and its hashed
    manifest root's 0755/0644; on a GPU node neither the admin's user nor the jobs' user can rename the
    cache or plant a wheel in it; only the admin's may make a folder in /scratch (fab stages jobs there)."""
    from bootstrap.node_pins import WHEEL_CACHE_DIR, WHEEL_MANIFEST

    bc = booted
    ctl = bc.containers[bc.facts.controller.name]
    scratch, user = bc.facts.scratch, bc.facts.ssh_user
    group = ctl.run(f"id -gn {user}").stdout.strip()
    assert ctl.run(f"stat -c '%U %G %a' {scratch}").stdout.strip() == f"root {group} 1775"
    if bc.platform.os_torch:  # no cache (the nodes' torch is the OS's): scratch is all there is to check
        return
    m = re.search(r"wheel cache (\S+): \d+ MB in \d+ s", bc.step_log(bc.facts.controller.name, "wheels"))
    assert m
    cache = m[1]
    modes = ctl.run(f"stat -c '%U %G %a' {scratch}/{WHEEL_CACHE_DIR} {cache} {cache}/{WHEEL_MANIFEST}"
                    ).stdout.splitlines()
    assert modes == ["root root 755", "root root 755", "root root 644"], modes
    node = bc.containers[bc.facts.gpu_nodes[0].name]
    for who in (user, bc.facts.job_user):
        for attempt in (f"mv {scratch}/{WHEEL_CACHE_DIR} {scratch}/moved", f"mv {cache} {cache}.moved",
                        f"touch {cache}/planted-0.1-py3-none-any.whl"):
            res = node.run(f"setpriv --reuid={who} --regid={who} --init-groups {attempt}", check=False)
            assert res.returncode != 0 and re.search("Operation not permitted|Permission denied", res.stderr), (
                who, attempt, res.stderr)
    job_mkdir = node.run(f"setpriv --reuid={bc.facts.job_user} --regid={bc.facts.job_user} --init-groups "
                         f"mkdir {scratch}/a-job-dir", check=False)
    assert job_mkdir.returncode != 0, "the jobs' user made a folder in /scratch's root"
    assert node.run(f"setpriv --reuid={user} --regid={user} --init-groups mkdir {scratch}/a-job-dir && "
                    f"rmdir {scratch}/a-job-dir", check=False).returncode == 0


def test_controller_reboot_keeps_the_metadata_guard(booted):
    """Persistent: after the controller reboots, its unit loads the rules again before the network."""
    bc = booted
    c = bc.containers[bc.facts.controller.name]
    with bc.phase("controller_reboot"):
        old = c.pid1()
        c.run("systemctl reboot --no-block", check=False)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and (c.pid1() in (None, old)):
            time.sleep(1)
        assert c.pid1() not in (None, old), f"the controller did not boot again; {c.tail()}"
        c.wait_running(timeout=180, settled=True)
    got = _metadata_as_each_user(bc)
    assert got["root"] == GUARD_KEY and got["slurm"] == GUARD_KEY, got
    assert got[bc.facts.ssh_user].startswith("refused: "), got
