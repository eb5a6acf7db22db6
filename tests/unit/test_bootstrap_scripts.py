"""The rendered scripts do what they say when run.

The health check runs for real against stand-in device files, with `scontrol` and
`nvidia-smi` replaced by recording stubs on PATH (the real drain on a real slurmctld
is the local cluster's test). The bootstrap scripts run for real, as root, inside
throw-away mount/UTS/network namespaces with /etc, /var and /usr behind tmpfs
overlays, so the machine itself is not changed.
"""

import os
import subprocess
from dataclasses import replace

import pytest

from bootstrap import node_layout, render, user_data
from tests.unit.test_bootstrap_render import FACTS


def write_exe(path, text):
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def hc(tmp_path):
    """A rendered health check for 4 stand-in GPUs, stubs on PATH."""
    devdir = tmp_path / "dev"
    devdir.mkdir()
    for i in range(4):
        (devdir / f"nvidia{i}").touch()
    facts = replace(FACTS["l4x2"], gpu_device_prefix=str(devdir / "nvidia"))
    script = tmp_path / "healthcheck"
    write_exe(script, render.render_healthcheck(facts))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "scontrol.calls"
    write_exe(bindir / "scontrol", f'#!/bin/bash\nprintf "%s\\n" "$@" > {calls}\n')

    def run(nvidia_smi=None):
        if nvidia_smi is not None:
            write_exe(bindir / "nvidia-smi", nvidia_smi)
        env = {"PATH": f"{bindir}:/usr/sbin:/usr/bin:/sbin:/bin", "SLURMD_NODENAME": "gpu-node-02"}
        res = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=60)
        drained = calls.read_text().splitlines() if calls.exists() else None
        return res, drained

    return devdir, run


def test_healthcheck_passes_with_all_devices(hc):
    _, run = hc
    res, drained = run()
    assert res.returncode == 0, res.stderr
    assert drained is None


def test_healthcheck_drains_on_a_missing_device(hc):
    devdir, run = hc
    (devdir / "nvidia2").unlink()
    res, drained = run()
    assert res.returncode != 0
    assert drained[:3] == ["update", "nodename=gpu-node-02", "state=drain"]
    assert drained[3] == f"reason=slurm-gpu-healthcheck: missing {devdir}/nvidia2"


def test_healthcheck_drains_when_nvidia_smi_sees_fewer_gpus(hc):
    _, run = hc
    res, drained = run("#!/bin/bash\nprintf '0\\n1\\n2\\n'\n")
    assert res.returncode != 0
    assert drained[3] == "reason=slurm-gpu-healthcheck: nvidia-smi sees 3 of 4 GPUs"
    res, drained = run("#!/bin/bash\nprintf '0\\n1\\n2\\n3\\n'\n")
    assert res.returncode == 0


def test_healthcheck_drains_when_nvidia_smi_fails(hc):
    _, run = hc
    res, drained = run("#!/bin/bash\necho 'NVIDIA-SMI has failed because it could not communicate'\nexit 9\n")
    assert res.returncode != 0
    assert drained[3].startswith("reason=slurm-gpu-healthcheck: nvidia-smi failed: NVIDIA-SMI has failed")


@pytest.mark.parametrize("role", node_layout.ROLES)
def test_unknown_skip_step_is_refused_before_any_change(tmp_path, role):
    script = tmp_path / "bootstrap.sh"
    write_exe(script, user_data.bootstrap_script(FACTS["l4x2"], role))
    env = {**os.environ, "SLURM_GPU_SKIP_STEPS": "packages nfs-server"}
    res = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "SLURM_GPU_SKIP_STEPS: unknown step 'nfs-server'" in res.stderr
    assert " ".join(node_layout.STEPS[role]) in res.stderr
    assert "step hostname" not in res.stdout  # nothing ran


# --- the bootstrap scripts, run for real in a sandbox (root) -----------------















