"""The controller's `scratchvol` step, run for real on a loop device standing in for the EBS volume.

On EC2 the volume is an NVMe device that udev links by its id (bootstrap/render.py EBS_LINK_PREFIX);
here a file-backed loop device is linked under such a name in a stand-in by-id folder (the
platform's scratch_volume_dir). The step runs as root in a throw-away mount namespace with /etc and
/var behind tmpfs overlays; /etc/fstab is carried to the next namespace, which is a reboot (nothing
mounted, the fstab line kept). Real mkfs.ext4, blkid, mount and fstab; only systemd is absent.
"""

import subprocess
from dataclasses import replace

import pytest

from bootstrap import node_layout, render, user_data
from cluster.facts import NodeShape
from cluster.platform import AWS
from tests.unit.test_bootstrap_render import make_facts

VOLUME_ID = "vol-0123456789abcdef0"

SANDBOX = r"""
set -euo pipefail
mount -t tmpfs tmpfs "$T/mnt"
for d in etc var; do
  mkdir -p "$T/mnt/u/$d" "$T/mnt/w/$d"
  mount -t overlay overlay -o "lowerdir=/$d,upperdir=$T/mnt/u/$d,workdir=$T/mnt/w/$d" "/$d"
done
# The disk's /etc/fstab: kept from the last boot (the host's at the first).
[ ! -e "$T/fstab" ] || cat "$T/fstab" > /etc/fstab
trap 'cat /etc/fstab > "$T/fstab"' EXIT
SLURM_GPU_SKIP_STEPS="$SKIP" "$SCRIPT"
SLURM_GPU_SKIP_STEPS="$SKIP" "$SCRIPT"  # again, mounted: nothing changes
[ -z "$WRITE" ] || echo "$WRITE" > "$SCRATCH/canary"
echo "R:mounted_uuid=$(findmnt -n -o UUID --mountpoint "$SCRATCH")"
echo "R:device_uuid=$(blkid -p -o value -s UUID "$DEV")"
echo "R:canary=$(cat "$SCRATCH/canary" 2>/dev/null || true)"
echo "R:fstab_lines=$(awk -v mp="$SCRATCH" '$2 == mp' /etc/fstab | wc -l)"
awk -v mp="$SCRATCH" '$2 == mp { print "R:fstab=" $0 }' /etc/fstab
echo "R:dropin=$(tr '\n' ' ' < "$DROPIN")"
"""


LINK = f"{render.EBS_LINK_PREFIX}0123456789abcdef0"


@pytest.fixture
def loops():
    """Makes 64 MiB file-backed loop devices; detaches them after the test."""
    made = []

    def make(image):
        with open(image, "wb") as f:
            f.truncate(64 << 20)
        loop = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True,
                              check=True).stdout.strip()
        made.append(loop)
        return loop

    yield make
    for loop in made:
        subprocess.run(["umount", loop], capture_output=True, check=False)
        subprocess.run(["losetup", "--detach", loop], check=False)


@pytest.fixture
def volume(tmp_path, loops):
    """A loop device linked as an EBS volume's by-id names (the plain one and systemd's `_1` one, as
    udev makes both), and the rendered script."""
    loop = loops(tmp_path / "volume.img")
    by_id = tmp_path / "by-id"
    by_id.mkdir()
    for name in (LINK, f"{LINK}_1"):
        (by_id / name).symlink_to(loop)
    facts = replace(make_facts("vol", "10.214.0.0/24", 1, NodeShape(2, 1000, 1, "l4")),
                    platform=replace(AWS, scratch_volume_dir=str(by_id)), scratch=str(tmp_path / "scratch"))
    script = tmp_path / "bootstrap.sh"
    script.write_text(user_data.bootstrap_script(facts, "controller"))
    script.chmod(0o755)
    return {"loop": loop, "dev": loop, "script": script, "facts": facts, "tmp": tmp_path, "by_id": by_id}


def boot(v, write="", expect_ok=True) -> dict:
    """One boot of the controller running only the scratchvol step, twice (it is safe to run again)."""
    (v["tmp"] / "mnt").mkdir(exist_ok=True)
    skip = " ".join(s for s in node_layout.STEPS["controller"] if s != "scratchvol")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "T": str(v["tmp"]), "SKIP": skip, "SCRIPT": str(v["script"]),
           "SCRATCH": v["facts"].scratch, "DEV": v["dev"], "WRITE": write, "DROPIN": render.SCRATCH_NFS_DROPIN}
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", SANDBOX],
                         env=env, capture_output=True, text=True, timeout=120)
    if not expect_ok:
        assert res.returncode != 0, res.stdout
        return {"err": res.stdout + res.stderr}
    assert res.returncode == 0, res.stdout + res.stderr
    out = dict(line[2:].split("=", 1) for line in res.stdout.splitlines() if line.startswith("R:"))
    out["log"] = res.stdout
    return out


@pytest.mark.root
def test_blank_volume_is_formatted_once_and_mounted_by_uuid_at_every_boot(volume):
    first = boot(volume, write="kept")
    assert first["mounted_uuid"] == first["device_uuid"] != ""
    assert "is blank: mkfs.ext4" in first["log"]
    assert first["fstab_lines"] == "1"
    assert first["fstab"] == f"UUID={first['device_uuid']} {volume['facts'].scratch} ext4 defaults,nofail 0 2"
    assert first["dropin"].strip() == f"[Unit] RequiresMountsFor={volume['facts'].scratch}"
    # A reboot (a new namespace: nothing mounted, fstab kept): the same file system, the file still there.
    again = boot(volume)
    assert "mkfs" not in again["log"]
    assert (again["device_uuid"], again["mounted_uuid"], again["canary"]) == (first["device_uuid"],) * 2 + ("kept",)
    assert again["fstab_lines"] == "1"


@pytest.mark.root
def test_a_volume_with_a_file_system_is_never_reformatted(volume):
    """A volume that outlived a replaced controller: its ext4 and its files are kept."""
    subprocess.run(["mkfs.ext4", "-q", "-L", "old", volume["loop"]], check=True)
    uuid = subprocess.run(["blkid", "-p", "-o", "value", "-s", "UUID", volume["loop"]], capture_output=True,
                          text=True, check=True).stdout.strip()
    out = boot(volume)
    assert "mkfs" not in out["log"]
    assert out["device_uuid"] == out["mounted_uuid"] == uuid


@pytest.mark.root
def test_a_volume_holding_something_else_is_refused_not_formatted(volume):
    """A partition table but no file system: blkid names no TYPE, so the step stops, wiping nothing."""
    subprocess.run(["sfdisk", "--quiet", volume["loop"]], input="label: gpt\n", text=True, check=True)
    out = boot(volume, expect_ok=False)
    assert "no file system blkid can name" in out["err"] and "not formatting it" in out["err"]
    pttype = subprocess.run(["blkid", "-p", "-o", "value", "-s", "PTTYPE", volume["loop"]], capture_output=True,
                            text=True).stdout.strip()
    assert pttype == "gpt"


@pytest.mark.root
def test_the_root_disk_is_passed_over_and_a_second_blank_disk_refused(volume, loops):
    """The one EBS disk nothing is mounted from is /scratch's: the root disk (an EBS volume too, with
    / mounted from it) is passed over; a second unmounted one is refused, naming both, formatting none."""
    root = loops(volume["tmp"] / "root.img")
    subprocess.run(["mkfs.ext4", "-q", root], check=True)
    (volume["tmp"] / "root-mnt").mkdir()
    subprocess.run(["mount", root, str(volume["tmp"] / "root-mnt")], check=True)
    (volume["by_id"] / f"{render.EBS_LINK_PREFIX}0fedcba9876543210").symlink_to(root)
    out = boot(volume)
    assert out["device_uuid"] == out["mounted_uuid"] != ""
    assert f"on {volume['loop']}" in out["log"]

    other = loops(volume["tmp"] / "other.img")
    (volume["by_id"] / f"{render.EBS_LINK_PREFIX}0aaaaaaaaaaaaaaaa").symlink_to(other)
    subprocess.run(["wipefs", "-a", "-q", volume["loop"]], check=True)  # both blank now
    out = boot(volume, expect_ok=False)
    assert "more than one unmounted EBS volume" in out["err"], out["err"]
    assert f"{volume['loop']} {LINK}" in out["err"], out["err"]  # the device and the volume it is
    assert f"{other} {render.EBS_LINK_PREFIX}0aaaaaaaaaaaaaaaa" in out["err"] and root not in out["err"]
    for dev in (volume["loop"], other):
        assert subprocess.run(["blkid", "-p", dev], capture_output=True).returncode == 2  # still blank


@pytest.mark.root
def test_no_volume_attached_stops_with_what_to_do(volume, monkeypatch):
    for link in volume["by_id"].iterdir():
        link.unlink()
    monkeypatch.setattr(render, "SCRATCH_VOLUME_WAIT_S", 4)
    volume["script"].write_text(user_data.bootstrap_script(volume["facts"], "controller"))
    out = boot(volume, expect_ok=False)
    assert "no EBS volume for " in out["err"] and "after 4s (attached, and mounted nowhere else): attach it" in out["err"]


def test_platforms_without_ebs_render_a_step_that_only_says_so():
    facts = make_facts("loc", "10.215.0.0/24", 1, NodeShape(2, 1000, 1, "l4"))
    local = replace(facts, platform=replace(AWS, scratch_volume_dir=None))
    script = user_data.bootstrap_script(local, "controller")
    body = script[script.index("step_scratchvol() {"):script.index("step_nfs() {")]
    assert "no EBS on this platform" in body and "mkfs" not in body and "fstab" not in body
