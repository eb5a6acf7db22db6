"""The controller's `scratchvol` step, run for real on a loop device standing in for the EBS volume.

On EC2 the volume is an NVMe device that udev links by its id (bootstrap/render.py scratch_device);
here a file-backed loop device is linked under the same name in a stand-in by-id folder (the
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
from tests.test_bootstrap_render import make_facts

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


@pytest.fixture
def volume(tmp_path):
    """A 64 MiB loop device linked as the volume's by-id name; its image and the rendered script."""
    image = tmp_path / "volume.img"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    loop = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True,
                          check=True).stdout.strip()
    try:
        by_id = tmp_path / "by-id"
        by_id.mkdir()
        facts = replace(make_facts("vol", "10.214.0.0/24", 1, NodeShape(2, 1000, 1, "l4")),
                        platform=replace(AWS, scratch_volume_dir=str(by_id)), scratch=str(tmp_path / "scratch"),
                        scratch_volume_id=VOLUME_ID)
        dev = render.scratch_device(facts)
        (by_id / dev.rsplit("/", 1)[1]).symlink_to(loop)
        script = tmp_path / "bootstrap.sh"
        script.write_text(user_data.bootstrap_script(facts, "controller"))
        script.chmod(0o755)
        yield {"loop": loop, "dev": dev, "script": script, "facts": facts, "tmp": tmp_path}
    finally:
        subprocess.run(["losetup", "--detach", loop], check=False)


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


def test_platforms_without_ebs_render_a_step_that_only_says_so():
    facts = make_facts("loc", "10.215.0.0/24", 1, NodeShape(2, 1000, 1, "l4"))
    local = replace(facts, platform=replace(AWS, scratch_volume_dir=None))
    script = user_data.bootstrap_script(local, "controller")
    body = script[script.index("step_scratchvol() {"):script.index("step_nfs() {")]
    assert "no EBS on this platform" in body and "mkfs" not in body and "fstab" not in body
    # An EBS platform rendered without the id refuses instead of leaving /scratch on the root disk.
    script = user_data.bootstrap_script(facts, "controller")
    body = script[script.index("step_scratchvol() {"):script.index("step_nfs() {")]
    assert "rendered without the /scratch volume's id" in body and "mkfs" not in body


@pytest.mark.parametrize("bad", ["vol-123", "vol-0123456789ABCDEF0", "vol-0123456789abcdef0; reboot", "sda"])
def test_a_malformed_volume_id_is_refused(bad):
    facts = replace(make_facts("bad", "10.216.0.0/24", 1, NodeShape(2, 1000, 1, "l4")), scratch_volume_id=bad)
    with pytest.raises(ValueError, match="scratch_volume_id must be an EBS volume id"):
        user_data.bootstrap_script(facts, "controller")
