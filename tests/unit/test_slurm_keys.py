"""Every key of every rendered Slurm file is one its platform's Slurm version accepts
(bootstrap/slurm_keys.py), for the AWS stacks and the local cluster."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from bootstrap import node_layout, render
from bootstrap.slurm_keys import ACCEPTED_KEYS, config_keys, unknown_keys
from cluster.facts import ClusterFacts, PowerSave
from cluster.platform import AWS, LOCAL
from localcluster import plan as local_plan
from tests.unit.test_bootstrap_render import FACTS

KIND = {node_layout.SLURM_CONF: "slurm.conf", node_layout.GRES_CONF: "gres.conf", node_layout.CGROUP_CONF: "cgroup.conf"}
EC2_POWER = PowerSave(1800, node_layout.SUSPEND_PATH, node_layout.RESUME_PATH, 300, 900, "ec2", 60)


def stacks() -> dict[str, ClusterFacts]:
    out = {f"aws-{name}": facts for name, facts in FACTS.items()}
    out["aws-l4x2-idle-stop"] = replace(FACTS["l4x2"], power_save=EC2_POWER)
    out["local"] = local_plan.cluster_facts(2, 2)
    out["local-idle-stop"] = local_plan.cluster_facts(2, 2, idle_stop_s=30)
    return out


STACKS = stacks()


@pytest.mark.parametrize("name", list(STACKS))
def test_every_rendered_key_is_accepted_by_the_platforms_slurm(name):
    facts = STACKS[name]
    files = {p: t for p, t in render.render_files(facts).items() if p in KIND}
    assert {KIND[p] for p in files} == ({"slurm.conf", "gres.conf", "cgroup.conf"} if facts.platform.cgroup
                                        else {"slurm.conf", "gres.conf"})
    for path, text in files.items():
        bad = unknown_keys(text, KIND[path], facts.platform.slurm)
        assert not bad, f"{path} of {name} has keys Slurm {facts.platform.slurm} does not accept: {bad}"


def test_the_stacks_cover_both_platforms_and_every_optional_section():
    assert {f.platform for f in STACKS.values()} == {AWS, LOCAL}
    slurm_keys = {k for f in STACKS.values() for _, k in config_keys(render.render_slurm_conf(f))}
    assert {"SuspendProgram", "SlurmctldParameters", "PropagateResourceLimitsExcept"} <= slurm_keys


def test_a_key_the_version_lacks_is_named():
    conf = render.render_slurm_conf(FACTS["l4x2"]) + "SuspendExcStates=DOWN\nNodeName=x Bogus=1\n"
    assert unknown_keys(conf, "slurm.conf", "23.11") == ["NodeName Bogus"]
    assert unknown_keys(conf, "slurm.conf", "22.05") == ["SuspendExcStates", "NodeName Bogus"]
    assert unknown_keys("ConstrainKmemSpace=yes\n", "cgroup.conf", "23.11") == ["ConstrainKmemSpace"]
    with pytest.raises(ValueError, match="no key table for Slurm 21.08"):
        unknown_keys(conf, "slurm.conf", "21.08")


LIBSLURM = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so")


def test_the_22_05_table_matches_the_installed_slurm():
    """Every key the table grants 22.05 is a C string of this machine's Slurm 22.05 library
    (Debian 12's slurm-wlm, which the local cluster runs). The linker may store a key as the
    tail of a longer string, so a key is looked for as "<key>\\0"."""
    version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "slurm-wlm"],
                             capture_output=True, text=True, check=True).stdout
    assert version.startswith(LOCAL.slurm + "."), f"slurm-wlm {version}: run scripts/setup.sh on {LOCAL.os}"
    data = LIBSLURM.read_bytes()
    for kind, keys in ACCEPTED_KEYS[LOCAL.slurm].items():
        missing = sorted(k for k in keys if k.encode() + b"\0" not in data)
        assert not missing, f"{kind} keys not in {LIBSLURM}: {missing}"
    # New in 23.11: the 22.05 library does not know them (the check can fail).
    for key in set(ACCEPTED_KEYS[AWS.slurm]["slurm.conf"]) - set(ACCEPTED_KEYS[LOCAL.slurm]["slurm.conf"]):
        assert key.encode() + b"\0" not in data, key
