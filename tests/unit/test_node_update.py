"""Bootstrap versions and the steps an update runs again (bootstrap/user_data.py, bootstrap/steps.py).

Each node records the version of the bootstrap it ran; `fab status` compares it with what the code
renders for that node, and `fab update-nodes` runs the steps a change touches. The real run on the
local cluster: tests/cluster/test_node_update_cluster.py.
"""

from __future__ import annotations

import base64
import gzip
import re
import shlex
from types import SimpleNamespace

import pytest
import yaml

from bootstrap import node_layout, node_pins, render, shipped_form, steps, user_data
from cluster import hostpaths
from cluster.targets.local import LOCAL_SKIP_STEPS
from ops.actions import node_update
from ops.ssh.remote import Cluster
from tests.unit.test_bootstrap_render import FACTS, make_facts

FACTS_L4 = FACTS["l4x2"]
GPU_STEPS = node_layout.STEPS["gpu"]


def _user_data_files(text: str) -> dict[str, str]:
    out = {}
    for f in yaml.safe_load(text)["write_files"]:
        raw = f["content"]
        out[f["path"]] = gzip.decompress(base64.b64decode(raw)).decode() if f.get("encoding") else raw
    return out


def test_the_version_is_a_deterministic_hash_of_the_nodes_own_files():
    v1 = user_data.bootstrap_version(FACTS_L4, "gpu", "gpu-node-01")
    assert v1 == user_data.bootstrap_version(FACTS_L4, "gpu", "gpu-node-01")
    assert len(v1) == 16 and int(v1, 16) >= 0
    assert v1 != user_data.bootstrap_version(FACTS_L4, "gpu", "gpu-node-02")  # its name and address
    # The user-data a node boots carries that version in its script, which records it at the end.
    files = _user_data_files(user_data.user_data(FACTS_L4, "gpu", "gpu-node-01"))
    assert files == shipped_form.shipped(user_data.bootstrap_files(FACTS_L4, "gpu", "gpu-node-01"))  # comments aside
    script = files[hostpaths.BOOTSTRAP_PATH]
    assert f"BOOTSTRAP_VERSION='{v1}'" in script
    assert f'echo "$BOOTSTRAP_VERSION" > \'{node_layout.VERSION_PATH}\'' in script
    controller = _user_data_files(user_data.user_data(FACTS_L4, "controller"))[hostpaths.BOOTSTRAP_PATH]
    assert f"BOOTSTRAP_VERSION='{user_data.bootstrap_version(FACTS_L4, 'controller', 'controller')}'" in controller


def test_the_version_follows_templates_and_pins_not_other_nodes(monkeypatch):
    v1 = user_data.bootstrap_version(FACTS_L4, "gpu", "gpu-node-01")
    grown = make_facts("mini", "10.0.1.0/24", 3, FACTS_L4.shape)
    assert user_data.bootstrap_version(grown, "gpu", "gpu-node-01") == v1  # a node added: no change here
    healthcheck = render.render_healthcheck
    monkeypatch.setattr(render, "render_healthcheck", lambda facts: healthcheck(facts) + "true  # newer\n")
    assert user_data.bootstrap_version(FACTS_L4, "gpu", "gpu-node-01") != v1
    monkeypatch.undo()
    pins = node_pins.training_requirements
    monkeypatch.setattr(render, "training_requirements",
                        lambda p: [x.replace("peft==", "peft==9.") for x in pins(p)])
    assert user_data.bootstrap_version(FACTS_L4, "gpu", "gpu-node-01") != v1


AWS_NODES = (("controller", None), ("gpu", "gpu-node-01"))


def test_the_local_clusters_skip_list_leaves_the_aws_version_alone(monkeypatch):
    """Issue 47: the local cluster's skip list (LOCAL_SKIP_STEPS) is named in a comment of every bootstrap
    script, which user-data drops; editing it showed every AWS node as "behind". The version is a hash of
    what the AWS hosts receive, so it stays; what they receive does change it."""
    versions = {role: user_data.bootstrap_version(FACTS_L4, role, host) for role, host in AWS_NODES}
    texts = {role: user_data.user_data(FACTS_L4, role, host) for role, host in AWS_NODES}
    scripts = {role: user_data.bootstrap_script(FACTS_L4, role, host) for role, host in AWS_NODES}
    monkeypatch.setitem(LOCAL_SKIP_STEPS, "gpu", (*LOCAL_SKIP_STEPS["gpu"], "gpus"))
    monkeypatch.setitem(LOCAL_SKIP_STEPS, "controller", LOCAL_SKIP_STEPS["controller"][1:])
    for role, host in AWS_NODES:
        assert user_data.bootstrap_script(FACTS_L4, role, host) != scripts[role]  # the comment names the new list
        assert user_data.user_data(FACTS_L4, role, host) == texts[role]  # the AWS hosts get the same bytes
        assert user_data.bootstrap_version(FACTS_L4, role, host) == versions[role]
    monkeypatch.setattr(render, "APT_LOCK_TIMEOUT_S", 901)  # in a file both roles receive
    for role, host in AWS_NODES:
        assert user_data.bootstrap_version(FACTS_L4, role, host) != versions[role]


def _script() -> str:
    return user_data.bootstrap_files(FACTS_L4, "gpu", "gpu-node-01")[hostpaths.BOOTSTRAP_PATH]


def test_a_changed_step_runs_alone():
    new = _script()
    old = new.replace('bash -n "$hc"', 'bash -n "$hc" || true')
    assert old != new
    assert steps.changed_steps(old, new, {hostpaths.BOOTSTRAP_PATH}, GPU_STEPS) == ["healthcheck"]


def test_a_changed_file_runs_the_step_that_reads_it():
    s = _script()
    assert steps.changed_steps(s, s, {node_layout.HOSTS_BLOCK_FILE}, GPU_STEPS) == ["hosts"]
    assert steps.changed_steps(s, s, {node_layout.SLURMD_DROPIN, hostpaths.HEALTHCHECK_PATH}, GPU_STEPS) == \
        ["healthcheck", "services"]
    assert steps.changed_steps(s, s, {node_layout.APT_LOCK_CONF}, GPU_STEPS) == []
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
    assert other != new and steps.changed_steps(other, new, {hostpaths.BOOTSTRAP_PATH}, GPU_STEPS) == []


def test_every_rendered_gpu_file_is_read_by_a_known_step():
    """A new rendered file needs its step in FILE_STEPS (else every update reruns all steps)."""
    files = set(user_data.bootstrap_files(FACTS_L4, "gpu", "gpu-node-01")) - {hostpaths.BOOTSTRAP_PATH}
    assert files <= set(steps.FILE_STEPS), sorted(files - set(steps.FILE_STEPS))
    assert {s for s in steps.FILE_STEPS.values() if s} <= set(GPU_STEPS)


# --- `update` with stand-ins: a controller that plays slurmctld, nodes that play the bootstrap ---

class _Res:
    def __init__(self, stdout: str = "", exited: int = 0, stderr: str = ""):
        self.stdout, self.stderr, self.exited, self.ok = stdout, stderr, exited, exited == 0


class FakeController:
    """The Slurm CLI as update() uses it: sinfo, squeue, scontrol ping/update (as root)."""
    user = "root"

    def __init__(self, names, *, slurm_2205=False, resume_fails=False):
        self.nodes = {n: ["idle", ""] for n in names}
        self.excluded: list[str] = []
        self.log: list[str] = []
        self.slurm_2205, self.resume_fails = slurm_2205, resume_fails

    def run(self, cmd, **_):
        self.log.append(cmd)
        if cmd == "scontrol ping":
            return _Res("Slurmctld(primary) at ctl is UP\n")
        if cmd.startswith("sinfo"):
            return _Res("".join(f"{n}|{s}|{r or 'none'}\n" for n, (s, r) in self.nodes.items()))
        if cmd.startswith("squeue"):
            return _Res("")
        m = re.match(r"scontrol update SuspendExcNodes([+-])=(\S+)$", cmd)
        if m:
            if self.slurm_2205:  # 22.05's scontrol knows no such update
                return _Res(exited=1, stderr="No valid entity in update command")
            (self.excluded.append if m.group(1) == "+" else self.excluded.remove)(m.group(2))
            return _Res()
        m = re.match(r"scontrol update nodename=(\S+) state=(\w+)(?: reason=(.*))?$", cmd)
        if m:
            name, state, reason = m.group(1), m.group(2), shlex.split(m.group(3) or "''")[0]
            if state == "drain":
                self.nodes[name] = ["drained", reason]
            elif self.resume_fails:
                return _Res(exited=1, stderr="slurm_update error: Invalid node state specified")
            else:
                self.nodes[name] = ["idle", ""]
            return _Res()
        raise AssertionError(f"unexpected command {cmd}")


NEW = "feedfacefeedface"


@pytest.fixture
def stand_in(monkeypatch):
    """update() over a FakeController and two nodes whose record is OLD; `apply` plays the bootstrap."""
    def make(apply=None, **ctl_kw):
        names = ["gpu-node-01", "gpu-node-02"]
        ctl = FakeController(names, **ctl_kw)
        recorded = {n: "0123456789abcdef" for n in names}
        answering = set(names)
        seen: list[tuple[str, list[str]]] = []  # (node, excluded from power saving while applied)

        def fake_apply(node, facts, name, target):
            seen.append((name, list(ctl.excluded)))
            if apply:
                apply(name, ctl, recorded, answering)
            recorded[name] = NEW
            return ["healthcheck"]

        def fake_versions(facts, conns):
            return {n: node_update.NodeVersion(n, recorded[n], NEW) for n in sorted(conns) if n in answering}

        monkeypatch.setattr(node_update, "facts_of", lambda inv: FACTS_L4)
        monkeypatch.setattr(node_update.targets, "of", lambda inv: None)
        monkeypatch.setattr(node_update, "versions", fake_versions)
        monkeypatch.setattr(node_update, "_apply", fake_apply)
        cl = Cluster(SimpleNamespace(), ctl, {n: SimpleNamespace(name=n) for n in names})
        return cl, ctl, recorded, seen
    return make


def test_update_keeps_power_saving_off_the_node_while_it_is_updated(stand_in):
    cl, ctl, _, seen = stand_in()
    said: list[str] = []
    result = node_update.update(cl, say=said.append)
    assert result.updated == {"gpu-node-01": ["healthcheck"], "gpu-node-02": ["healthcheck"]}
    assert seen == [("gpu-node-01", ["gpu-node-01"]), ("gpu-node-02", ["gpu-node-02"])]
    assert ctl.excluded == []  # given back after each node
    assert {n: s for n, (s, _) in ctl.nodes.items()} == {"gpu-node-01": "idle", "gpu-node-02": "idle"}
    # The exclusion comes before the drain (a drained idle node is what power saving stops).
    log = [c for c in ctl.log if c.startswith("scontrol update")]
    assert log[:2] == ["scontrol update SuspendExcNodes+=gpu-node-01",
                       f"scontrol update nodename=gpu-node-01 state=drain reason='{node_update.REASON}'"]


def test_the_exclusion_is_given_back_when_the_update_fails(stand_in):
    def broken(name, ctl, recorded, answering):
        raise OSError("Socket is closed")

    cl, ctl, _, _ = stand_in(apply=broken)
    with pytest.raises(node_update.UpdateError) as info:
        node_update.update(cl, say=lambda s: None)
    assert "gpu-node-01: the update broke off (Socket is closed)" in str(info.value)
    assert "`scontrol update nodename=gpu-node-01 state=resume` on the controller" in str(info.value)
    assert ctl.excluded == [] and ctl.nodes["gpu-node-01"] == ["drained", node_update.REASON]


def test_slurm_2205_cannot_exclude_and_says_so(stand_in):
    cl, ctl, _, _ = stand_in(slurm_2205=True)
    said: list[str] = []
    result = node_update.update(cl, say=said.append)
    assert sorted(result.updated) == ["gpu-node-01", "gpu-node-02"]
    notes = [s for s in said if "cannot keep power saving off" in s]
    assert len(notes) == 2 and "needs Slurm 23.02 or later" in notes[0]
    assert not any("SuspendExcNodes-=" in c for c in ctl.log)


def test_a_health_check_drain_during_the_update_is_left_drained(stand_in):
    """slurmd runs the health check at start; the services step restarts slurmd."""
    def health_drains(name, ctl, recorded, answering):
        if name == "gpu-node-01":
            ctl.nodes[name] = ["drained", "health: GPU 2 fell off the bus"]

    cl, ctl, _, _ = stand_in(apply=health_drains)
    said: list[str] = []
    result = node_update.update(cl, say=said.append)
    assert ctl.nodes["gpu-node-01"] == ["drained", "health: GPU 2 fell off the bus"]
    assert "health: GPU 2 fell off the bus" in result.drained["gpu-node-01"]
    assert not any(s.startswith("update-nodes: gpu-node-01") and s.endswith("resumed") for s in said)
    assert "left drained: gpu-node-01" in said[-1]
    assert ctl.nodes["gpu-node-02"] == ["idle", ""]


def test_a_node_drained_by_an_interrupted_update_is_taken_up_again(stand_in):
    cl, ctl, recorded, _ = stand_in()
    ctl.nodes["gpu-node-01"] = ["drained", node_update.REASON]
    ctl.nodes["gpu-node-02"] = ["drained", node_update.REASON]
    recorded["gpu-node-02"] = NEW  # its bootstrap ran to the end; only the resume was lost
    result = node_update.update(cl, say=lambda s: None)
    assert sorted(result.updated) == ["gpu-node-01", "gpu-node-02"] and result.skipped == {}
    assert {n: s for n, (s, _) in ctl.nodes.items()} == {"gpu-node-01": "idle", "gpu-node-02": "idle"}
    # Drained by someone else: skipped, untouched.
    cl, ctl, _, _ = stand_in()
    ctl.nodes["gpu-node-01"] = ["drained", "disk replacement"]
    result = node_update.update(cl, say=lambda s: None)
    assert "disk replacement" in result.skipped["gpu-node-01"]
    assert ctl.nodes["gpu-node-01"] == ["drained", "disk replacement"]


def test_a_node_that_stops_answering_after_its_update_is_named_with_the_resume_command(stand_in):
    def stopped(name, ctl, recorded, answering):
        answering.discard(name)

    cl, ctl, _, _ = stand_in(apply=stopped)
    with pytest.raises(node_update.UpdateError) as info:
        node_update.update(cl, say=lambda s: None)
    msg = str(info.value)
    assert "gpu-node-01: no longer answers over SSH after its update" in msg
    assert "`scontrol update nodename=gpu-node-01 state=resume` on the controller" in msg
    assert ctl.excluded == []


def test_a_failed_resume_is_not_reported_as_resumed(stand_in):
    cl, ctl, _, _ = stand_in(resume_fails=True)
    said: list[str] = []
    result = node_update.update(cl, say=said.append)
    assert "resuming it failed (slurm_update error: Invalid node state specified)" in result.drained["gpu-node-01"]
    assert not any(s.endswith("resumed") for s in said)


def test_behind_warning_names_the_nodes_for_fab_train(stand_in):
    cl, _, recorded, _ = stand_in()
    recorded["gpu-node-02"] = NEW
    line = node_update.behind_warning(cl)
    assert line is not None and line.startswith("warning: gpu-node-01 ran an older bootstrap")
    assert "gpu-node-02" not in line and "`fab update-nodes`" in line
    recorded["gpu-node-01"] = NEW
    assert node_update.behind_warning(cl) is None
