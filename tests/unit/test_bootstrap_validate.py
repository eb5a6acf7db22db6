"""Real validators on the rendered output: cloud-init's schema, shellcheck, and
Slurm 22.05's own parser (`slurmd -G` reads slurm.conf and gres.conf, prints the
node's GRES and exits; it starts no daemon)."""

import json
import shutil
import subprocess
from dataclasses import replace

import pytest

from bootstrap import node_layout, render, shipped_form, user_data
from cluster import hostpaths
from tests.unit.test_bootstrap_render import CASES, FACTS, FULL


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def need(tool):
    # These tools are installed by scripts/setup.sh; missing means a broken setup.
    assert shutil.which(tool), f"{tool} not found: run scripts/setup.sh"


def schema(path):
    need("cloud-init")
    return run(["cloud-init", "schema", "--config-file", str(path)])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("role", node_layout.ROLES)
def test_user_data_passes_cloud_init_schema(tmp_path, case, role):
    path = tmp_path / f"{case}-{role}.yaml"
    path.write_text(user_data.user_data(FACTS[case], role))
    res = schema(path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Valid cloud-config" in res.stdout


@pytest.mark.parametrize("role", node_layout.ROLES)
def test_gzip_user_data_of_a_full_subnet_passes_schema(tmp_path, role):
    """The bytes EC2 hands the node (gzip), unpacked by cloud-init's own code (the system Python's
    cloudinit.util.decomp_gzip, which its user-data processing calls), then validated."""
    need("cloud-init")
    packed = tmp_path / f"full-{role}.gz"
    packed.write_bytes(user_data.user_data_gzip(FULL, role))
    path = tmp_path / f"full-{role}.yaml"
    unpack = run(["/usr/bin/python3", "-c", "import sys; from cloudinit import util; "
                  "sys.stdout.write(util.decomp_gzip(open(sys.argv[1], 'rb').read()))", str(packed)])
    assert unpack.returncode == 0, unpack.stderr
    path.write_text(unpack.stdout)
    assert unpack.stdout == user_data.user_data(FULL, role)
    res = schema(path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_cloud_init_schema_rejects_a_broken_user_data(tmp_path):
    # Proves the validator really checks: one wrong type in our own output fails.
    text = user_data.user_data(FACTS["l4x2"], "gpu")
    assert "\npreserve_hostname: true\n" in text
    path = tmp_path / "broken.yaml"
    path.write_text(text.replace("\npreserve_hostname: true\n", "\npreserve_hostname: [1]\n"))
    res = schema(path)
    assert res.returncode != 0
    assert "preserve_hostname" in res.stdout + res.stderr


def scripts_of(facts):
    yield "healthcheck", render.render_healthcheck(facts)
    yield "controller", user_data.bootstrap_script(facts, "controller", facts.controller.name)
    yield "gpu", user_data.bootstrap_script(facts, "gpu")
    yield "gpu-named", user_data.bootstrap_script(facts, "gpu", facts.gpu_nodes[-1].name)


def test_scripts_pass_shellcheck(tmp_path):
    need("shellcheck")
    paths = []
    # One shellcheck run; h100x3 renders the same code as l4x2 with other numbers.
    # l4x2: the controller's scratchvol step as AWS renders it.
    cases = {"l4x2": FACTS["l4x2"], "single": FACTS["single"]}
    for case, facts in cases.items():
        for name, text in scripts_of(facts):
            p = tmp_path / f"{case}-{name}.sh"
            p.write_text(text)
            paths.append(str(p))
    res = run(["shellcheck", "--shell=bash", "--severity=style", *paths])
    assert res.returncode == 0, res.stdout + res.stderr


def test_shellcheck_rejects_a_broken_script(tmp_path):
    need("shellcheck")
    p = tmp_path / "broken.sh"
    p.write_text(render.render_healthcheck(FACTS["l4x2"]).replace('[ -e "$dev" ]', "[ -e $dev ]"))
    res = run(["shellcheck", "--shell=bash", str(p)])
    assert res.returncode != 0 and "SC2086" in res.stdout


def write_slurm_files(tmp_path, facts, shipped=False):
    """Render with stand-in device files (slurmd insists the files exist); `shipped`: as user-data
    carries them (bootstrap/shipped_form.py: no comment lines)."""
    prefix = tmp_path / "dev" / "nvidia"
    prefix.parent.mkdir()
    for i in range(facts.shape.gpu_count):
        (prefix.parent / f"nvidia{i}").touch()
    facts = replace(facts, gpu_device_prefix=str(prefix))
    form = shipped_form.shipped_slurm_config if shipped else str
    (tmp_path / "slurm.conf").write_text(form(render.render_slurm_conf(facts)))
    (tmp_path / "gres.conf").write_text(form(render.render_gres_conf(facts)))
    return tmp_path / "slurm.conf"


def slurmd_gres(conf, node, log):
    need("slurmd")
    # -L keeps slurmd's log out of /var/log/slurm.
    return run(["slurmd", "-G", "-N", node, "-L", str(log)], env={"SLURM_CONF": str(conf), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


@pytest.mark.parametrize("shipped", [False, True], ids=["rendered", "as-user-data-ships-it"])
@pytest.mark.parametrize("case", CASES)
def test_slurm_parses_slurm_conf_and_gres_conf(tmp_path, case, shipped):
    facts = FACTS[case]
    conf = write_slurm_files(tmp_path, facts, shipped)
    if shipped:  # the comment lines are gone, all but the first (what rendered it)
        assert [line for line in conf.read_text().splitlines() if line.startswith("#")] == [
            render.render_slurm_conf(facts).splitlines()[0]]
    for host in (facts.gpu_nodes[0], facts.gpu_nodes[-1]):
        res = slurmd_gres(conf, host.name, tmp_path / "slurmd.log")
        out = res.stdout + res.stderr
        assert res.returncode == 0, out
        assert "fatal" not in out and "Parsing error" not in out
        assert f"Gres Name=gpu Type={facts.shape.gpu_type} Count={facts.shape.gpu_count}" in out


def test_slurm_parser_rejects_a_bad_key(tmp_path):
    conf = write_slurm_files(tmp_path, FACTS["l4x2"])
    conf.write_text(conf.read_text() + "NoSuchParameter=1\n")
    res = slurmd_gres(conf, "gpu-node-01", tmp_path / "slurmd.log")
    assert res.returncode != 0
    assert "NoSuchParameter" in res.stdout + res.stderr


def test_cloud_init_decodes_encoded_files_back_to_the_rendered_text(tmp_path):
    # cloud-init's own write_files decoder (system python3), not ours.
    path = tmp_path / "full-gpu.yaml"
    path.write_text(user_data.user_data(FULL, "gpu"))
    code = (
        "import json, sys, yaml\n"
        "from cloudinit.config.cc_write_files import canonicalize_extraction, extract_contents\n"
        "cfg = yaml.safe_load(open(sys.argv[1]))\n"
        "out = {}\n"
        "for f in cfg['write_files']:\n"
        "    c = extract_contents(f['content'], canonicalize_extraction(f.get('encoding')))\n"
        "    out[f['path']] = c if isinstance(c, str) else c.decode()\n"
        "print(json.dumps(out))\n"
    )
    res = run(["/usr/bin/python3", "-c", code, str(path)])
    assert res.returncode == 0, res.stderr
    expected = render.role_files(FULL, "gpu")
    expected[hostpaths.BOOTSTRAP_PATH] = user_data.bootstrap_script(FULL, "gpu")
    expected[node_layout.APT_LOCK_CONF] = render.render_apt_lock_conf(FULL)
    assert json.loads(res.stdout) == shipped_form.shipped(expected)
