"""The controller's instance metadata guard (bootstrap/node_layout.py IMDS_GUARD_*; its bootstrap's `imds`
step): only root and SlurmUser reach the metadata service, whose answers hold the power role's
credentials.

The rendered rules are loaded with this machine's real nft into a private network namespace, with the
stand-in metadata service (tests/support/imds_standin.py) on that namespace's loopback serving a role's
credentials; then botocore's own credential chain (what the power program's boto3 runs) asks for them
as each user. The boot test (tests/boot/test_boot_cluster.py) does the same on a booted controller.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bootstrap import node_layout, render, user_data
from cluster.targets.local import LOCAL_SKIP_STEPS
from tests.unit.test_bootstrap_render import FACTS

REPO = Path(__file__).resolve().parents[2]
PORT = 18169
FAKE_KEY = "ASIASTANDINGUARDTEST"
USERS = {"root": 0, "slurm": 64030, "admin (uid 1000)": 1000, "nobody": 65534}

# Runs in its own network namespace (unshare -n): nothing outside it sees the rules or the stand-in.
NETNS_SCRIPT = r"""
set -euo pipefail
ip link set lo up
nft -f "$RULES"
"$PY" "$STANDIN" "$PORT" "$STATE" & standin=$!
trap 'kill $standin' EXIT
for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/"$PORT") 2>/dev/null && break; sleep 0.1; done
for uid in $UIDS; do
  printf '%s ' "$uid"
  setpriv --reuid="$uid" --regid="$uid" --clear-groups env -i HOME=/nonexistent PYTHONPATH="$SITE" \
    AWS_EC2_METADATA_SERVICE_ENDPOINT="http://127.0.0.1:$PORT/" AWS_METADATA_SERVICE_NUM_ATTEMPTS=1 \
    AWS_METADATA_SERVICE_TIMEOUT=2 /usr/bin/python3 -c "$PROBE"
done
"""
PROBE = ("import botocore.session as s; c = s.get_session().get_credentials(); "
         "print(c.get_frozen_credentials().access_key if c else 'none')")


def test_only_the_controller_gets_the_guard_for_the_real_service():
    facts = FACTS["l4x2"]
    controller, gpu = (render.role_files(facts, role) for role in node_layout.ROLES)
    assert {node_layout.IMDS_GUARD_RULES, node_layout.IMDS_GUARD_UNIT_PATH} <= set(controller)
    assert not {node_layout.IMDS_GUARD_RULES, node_layout.IMDS_GUARD_UNIT_PATH} & set(gpu)  # no role there
    rules = [ln.strip() for ln in controller[node_layout.IMDS_GUARD_RULES].splitlines() if "reject" in ln]
    assert rules == [f"{ip} daddr {addr} tcp dport 80 meta skuid != {{ root, slurm }} reject with tcp reset"
                     for ip, addr in (("ip", "169.254.169.254"), ("ip6", "fd00:ec2::254"))]
    unit = controller[node_layout.IMDS_GUARD_UNIT_PATH]
    assert f"ExecStart=/usr/sbin/nft -f {node_layout.IMDS_GUARD_RULES}" in unit
    assert "Before=network-pre.target" in unit and "WantedBy=sysinit.target" in unit
    script = user_data.bootstrap_script(facts, "controller")
    assert f"systemctl enable {node_layout.IMDS_GUARD_UNIT}" in script
    assert "imds" in LOCAL_SKIP_STEPS["controller"]  # the local cluster's hosts share one machine


# Where systemd reads a drop-in of slurmctld.service (systemd.unit(5), "<unit>.d/*.conf").
SLURMCTLD_DROPINS = "/etc/systemd/system/slurmctld.service.d/"
GUARD_DEPS = ("Requires", "After")


def _unit_values(text: str) -> dict[str, list[str]]:
    """systemd unit text -> key -> each space-separated value, over all its lines."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        if eq and not line.startswith("#"):
            found.setdefault(key.strip(), []).extend(value.split())
    return found


def test_slurmctld_runs_only_with_the_guard_loaded_after_nftables():
    """Fails closed: slurmctld (and so the power programs) requires the guard's unit and starts after
    it; the guard loads after nftables.service (whose /etc/nftables.conf flushes every table) and
    before slurmctld. GPU nodes get neither."""
    controller, gpu = (render.role_files(FACTS["l4x2"], role) for role in node_layout.ROLES)
    dropins = {p: t for p, t in controller.items() if p.startswith(SLURMCTLD_DROPINS) and p.endswith(".conf")}
    required = [p for p, t in dropins.items()
                if all(node_layout.IMDS_GUARD_UNIT in _unit_values(t).get(k, []) for k in GUARD_DEPS)]
    assert len(required) == 1, sorted(dropins)
    assert not any(p.startswith(SLURMCTLD_DROPINS) for p in gpu)
    unit = _unit_values(controller[node_layout.IMDS_GUARD_UNIT_PATH])
    assert "nftables.service" in unit["After"] and "slurmctld.service" in unit["Before"]
    assert "network-pre.target" in unit["Before"] and unit["DefaultDependencies"] == ["no"]


def _systemd_verify(units_dir: Path, unit: str) -> subprocess.CompletedProcess:
    """systemd's own reading of `unit` with `units_dir` first on its unit path (SYSTEMD_UNIT_PATH,
    ending in ":" for the system's own directories after it: Debian's slurmctld.service, nftables.service):
    `systemd-analyze verify` loads it and its drop-ins and builds its start transaction."""
    return subprocess.run(["systemd-analyze", "verify", "--man=no", unit], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "SYSTEMD_UNIT_PATH": f"{units_dir}:"})


def test_systemd_starts_slurmctld_with_the_guard_and_no_cycle(tmp_path):
    """The rendered units under this machine's real systemd and Debian's slurmctld.service: starting
    slurmctld pulls in the guard with no ordering cycle; the drop-in is read (the same drop-in naming a
    missing unit makes that start fail)."""
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing: apt-get install systemd"
    assert Path("/lib/systemd/system/slurmctld.service").exists(), "apt-get install slurmctld (Debian's unit)"
    units = tmp_path / "units"
    controller = render.role_files(FACTS["l4x2"], "controller")
    for path, text in controller.items():
        if path.startswith("/etc/systemd/system/"):
            (units / path.removeprefix("/etc/systemd/system/")).parent.mkdir(parents=True, exist_ok=True)
            (units / path.removeprefix("/etc/systemd/system/")).write_text(text)
    for unit in ("slurmctld.service", node_layout.IMDS_GUARD_UNIT):
        res = _systemd_verify(units, unit)
        assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    dropin = next((units / "slurmctld.service.d").iterdir())
    dropin.write_text(dropin.read_text().replace(node_layout.IMDS_GUARD_UNIT, "slurm-gpu-missing.service"))
    res = _systemd_verify(units, "slurmctld.service")
    assert res.returncode != 0 and "slurm-gpu-missing.service" in res.stderr, res.stderr


@pytest.mark.parametrize("imds", ["http://metadata.local", "http://[fd00:ec2::254]", "http://1.2.3.4:80; x"])
def test_a_guard_for_anything_but_an_ipv4_address_is_refused(imds):
    with pytest.raises(ValueError, match="spot_imds must be http://IPV4"):
        render.render_imds_guard(dataclasses.replace(FACTS["l4x2"], spot_imds=imds))


@pytest.mark.root
def test_only_root_and_slurm_take_the_role_credentials(tmp_path):
    """Real nft, real sockets, botocore's real credential chain: root and slurm (the power programs'
    user) get the role's key; the admin's uid and nobody get nothing (their connections are reset)."""
    for tool in ("nft", "setpriv", "unshare"):
        assert shutil.which(tool), f"{tool} is missing: apt-get install nftables util-linux"
    assert os.geteuid() == 0, "loads nftables rules in a private network namespace: run as root"
    assert subprocess.run(["id", "-u", "slurm"], capture_output=True, text=True).stdout.strip() == str(
        USERS["slurm"]), "the slurm user (Debian's slurm-wlm, uid 64030) is missing"
    facts = dataclasses.replace(FACTS["l4x2"], spot_imds=f"http://127.0.0.1:{PORT}")
    rules = tmp_path / "imds-guard.nft"
    rules.write_text(render.render_imds_guard(facts)[node_layout.IMDS_GUARD_RULES])
    state = tmp_path / "imds.json"
    state.write_text(json.dumps({"credentials": {
        "role": "slurm-gpu-power", "Code": "Success", "AccessKeyId": FAKE_KEY, "SecretAccessKey": "x" * 40,
        "Token": "standin", "Expiration": "2099-01-01T00:00:00Z"}}))
    site = next(p for p in sys.path if p.endswith("site-packages") and (Path(p) / "botocore").is_dir())
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "RULES": str(rules), "PY": sys.executable,
           "STANDIN": str(REPO / "tests" / "support" / "imds_standin.py"), "PORT": str(PORT), "STATE": str(state),
           "UIDS": " ".join(str(u) for u in USERS.values()), "SITE": site, "PROBE": PROBE}
    res = subprocess.run(["unshare", "--net", "bash", "-c", NETNS_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    got = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    assert got == {"0": FAKE_KEY, "64030": FAKE_KEY, "1000": "none", "65534": "none"}, res.stderr


APT_STANDIN = '#!/bin/bash\necho "$*" >> "$T/apt-calls"\n'


def test_first_boot_has_nft_before_the_slurm_package_starts_slurmctld(tmp_path):
    """The slurm package starts slurmctld when apt configures it, and slurmctld now requires the guard,
    which nft loads: the controller's packages step installs nftables before the rest (else that start,
    and so the package's configuration, fails). The `imds` step (enables the guard) runs before
    `services` (starts slurmctld). Run for real with stand-ins for apt-get and dpkg-query on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool, text in (("apt-get", APT_STANDIN), ("dpkg-query", "#!/bin/sh\nexit 1\n")):  # nothing installed
        (bindir / tool).write_text(text)
        (bindir / tool).chmod(0o755)
    facts = FACTS["l4x2"]
    script = user_data.bootstrap_script(facts, "controller").rsplit("run_steps", 1)[0]
    (tmp_path / "controller.sh").write_text(script)
    res = subprocess.run(["bash", "-c", f'source "{tmp_path}/controller.sh"; step_packages'],
                         env={"PATH": f"{bindir}:/usr/bin:/bin", "T": str(tmp_path)}, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    installs = [c.split(" install -y ", 1)[1].split() for c in (tmp_path / "apt-calls").read_text().splitlines()
                if " install -y " in c]
    assert installs[0] == ["nftables"] and "slurm-wlm" in installs[-1], installs
    order = node_layout.STEPS["controller"]
    assert order.index("packages") < order.index("imds") < order.index("services")
