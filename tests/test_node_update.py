"""Bootstrap versions and the steps an update runs again (bootstrap/render.py, bootstrap/steps.py).

Each node records the version of the bootstrap it ran; `fab status` compares it with what the code
renders for that node, and `fab update-nodes` runs the steps a change touches. The real run on the
local cluster: tests/test_node_update_cluster.py.
"""

from __future__ import annotations

import base64
import gzip

import yaml

from bootstrap import render, steps
from tests.test_bootstrap_render import FACTS, make_facts

FACTS_L4 = FACTS["l4x2"]
GPU_STEPS = render.STEPS["gpu"]


def _user_data_files(text: str) -> dict[str, str]:
    out = {}
    for f in yaml.safe_load(text)["write_files"]:
        raw = f["content"]
        out[f["path"]] = gzip.decompress(base64.b64decode(raw)).decode() if f.get("encoding") else raw
    return out


def test_the_version_is_a_deterministic_hash_of_the_nodes_own_files():
    v1 = render.bootstrap_version(FACTS_L4, "gpu", "gpu-node-01")
    assert v1 == render.bootstrap_version(FACTS_L4, "gpu", "gpu-node-01")
    assert len(v1) == 16 and int(v1, 16) >= 0
    assert v1 != render.bootstrap_version(FACTS_L4, "gpu", "gpu-node-02")  # its name and address
    # The user-data a node boots carries that version in its script, which records it at the end.
    files = _user_data_files(render.user_data(FACTS_L4, "gpu", "gpu-node-01"))
    assert files == render.bootstrap_files(FACTS_L4, "gpu", "gpu-node-01")
    script = files[render.BOOTSTRAP_PATH]
    assert f"BOOTSTRAP_VERSION='{v1}'" in script
    assert f'echo "$BOOTSTRAP_VERSION" > \'{render.VERSION_PATH}\'' in script
    controller = _user_data_files(render.user_data(FACTS_L4, "controller"))[render.BOOTSTRAP_PATH]
    assert f"BOOTSTRAP_VERSION='{render.bootstrap_version(FACTS_L4, 'controller', 'controller')}'" in controller


def test_the_version_follows_templates_and_pins_not_other_nodes(monkeypatch):
    v1 = render.bootstrap_version(FACTS_L4, "gpu", "gpu-node-01")
    grown = make_facts("mini", "10.0.1.0/24", 3, FACTS_L4.shape)
    assert render.bootstrap_version(grown, "gpu", "gpu-node-01") == v1  # a node added: no change here
    healthcheck = render.render_healthcheck
    monkeypatch.setattr(render, "render_healthcheck", lambda facts: healthcheck(facts) + "# newer\n")
    assert render.bootstrap_version(FACTS_L4, "gpu", "gpu-node-01") != v1
    monkeypatch.undo()
    pins = render.training_requirements
    monkeypatch.setattr(render, "training_requirements",
                        lambda p: [x.replace("peft==", "peft==9.") for x in pins(p)])
    assert render.bootstrap_version(FACTS_L4, "gpu", "gpu-node-01") != v1


def _script() -> str:
    return render.bootstrap_files(FACTS_L4, "gpu", "gpu-node-01")[render.BOOTSTRAP_PATH]


def test_a_changed_step_runs_alone():
    new = _script()
    old = new.replace('bash -n "$hc"', 'bash -n "$hc" || true')
    assert old != new
    assert steps.changed_steps(old, new, {render.BOOTSTRAP_PATH}, GPU_STEPS) == ["healthcheck"]


def test_a_changed_file_runs_the_step_that_reads_it():
    s = _script()
    assert steps.changed_steps(s, s, {render.HOSTS_BLOCK_FILE}, GPU_STEPS) == ["hosts"]
    assert steps.changed_steps(s, s, {render.SLURMD_DROPIN, render.HEALTHCHECK_PATH}, GPU_STEPS) == \
        ["healthcheck", "services"]
    assert steps.changed_steps(s, s, {render.APT_LOCK_CONF}, GPU_STEPS) == []
    assert steps.changed_steps(s, s, {"/etc/slurm-gpu/something-new"}, GPU_STEPS) == list(GPU_STEPS)


def test_a_changed_helper_or_head_or_unknown_old_script_runs_every_step():
    new = _script()
    assert steps.changed_steps(None, new, set(), GPU_STEPS) == list(GPU_STEPS)
    helper = new.replace('log() { echo', 'log() {  echo')
    assert helper != new and steps.changed_steps(helper, new, set(), GPU_STEPS) == list(GPU_STEPS)
    head = new.replace("set -o errtrace", "set -o errtrace\numask 022")
    assert steps.changed_steps(head, new, set(), GPU_STEPS) == list(GPU_STEPS)
    # Only the version line or comments: no step (the run only records the new version).
    other = new.replace("BOOTSTRAP_VERSION='", "BOOTSTRAP_VERSION='0").replace("# Steps, in order", "# Steps")
    assert other != new and steps.changed_steps(other, new, {render.BOOTSTRAP_PATH}, GPU_STEPS) == []


def test_every_rendered_gpu_file_is_read_by_a_known_step():
    """A new rendered file needs its step in FILE_STEPS (else every update reruns all steps)."""
    files = set(render.bootstrap_files(FACTS_L4, "gpu", "gpu-node-01")) - {render.BOOTSTRAP_PATH}
    assert files <= set(steps.FILE_STEPS), sorted(files - set(steps.FILE_STEPS))
    assert {s for s in steps.FILE_STEPS.values() if s} <= set(GPU_STEPS)
