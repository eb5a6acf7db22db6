"""Idle GPU nodes stop paying: the setting, slurm.conf, the EC2 power programs (boto3 against
botocore's Stubber, hostlists by the real scontrol), the controller's `power` step that installs
their boto3, the controller's tag-scoped role in the mocked program, and the sinfo power flags
fab reads. The local cluster's real run is test_power_save_cluster.py."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import tests.support.pulumi_mocks as harness
from bootstrap import node_layout, node_pins, render, user_data
from cluster.facts import STACK_TAG, ClusterFacts, NodeShape, PowerSave, plan_hosts
from cluster.inventory import Inventory
from cluster.stack_config import ConfigError, StackConfig
from ops.actions import node_power as power
from ops.actions import slurm
from tests.support.pulumi_mocks import stack_config

BASE = {"adminCidr": harness.ADMIN_CIDR, "sshPublicKey": harness.SSH_KEY}


# ---------------------------------------------------------------- the setting

def test_idle_stop_defaults_to_30_minutes_and_0_turns_it_off():
    assert StackConfig.from_mapping(BASE).idle_stop_minutes == 30
    assert StackConfig.from_mapping({**BASE, "idleStopMinutes": "0"}).idle_stop_minutes == 0
    assert StackConfig.from_mapping({**BASE, "idleStopMinutes": 120}).idle_stop_minutes == 120


@pytest.mark.parametrize("value", ["3", "-5", "ten", "1.5", "true", "20000"])
def test_bad_idle_stop_names_the_setting_and_the_fix(value):
    with pytest.raises(ConfigError) as err:
        StackConfig.from_mapping({**BASE, "idleStopMinutes": value})
    msg = str(err.value)
    assert msg.startswith("slurm-gpu:idleStopMinutes ")
    assert "`pulumi config set slurm-gpu:idleStopMinutes 30`" in msg


# ---------------------------------------------------------------- slurm.conf

REGION, STACK = "ap-northeast-2", "acme/slurm-gpu/prod"  # the stack's, as infra/program.py puts them in the facts


def facts(power_save: PowerSave | None, cluster: str = "mini", region: str | None = REGION) -> ClusterFacts:
    ctl, nodes = plan_hosts("10.0.1.0/24", 3)
    return ClusterFacts(cluster, ctl, nodes, NodeShape(48, 184800, 4, "l4"), "10.0.1.0/24",
                        power_save=power_save, region=region, stack=STACK)


EC2 = PowerSave(suspend_time=1800, suspend_program="/usr/local/sbin/slurm-gpu-suspend",
                resume_program="/usr/local/sbin/slurm-gpu-resume", suspend_timeout=180,
                resume_timeout=900, provider="ec2")


def conf_keys(text: str) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in text.splitlines() if re.match(r"^[A-Za-z]+=", ln))


def test_slurm_conf_power_keys():
    keys = conf_keys(render.render_slurm_conf(facts(EC2)))
    assert {k: keys[k] for k in ("SuspendProgram", "ResumeProgram", "SuspendTime", "SuspendTimeout",
                                 "ResumeTimeout")} == {
        "SuspendProgram": "/usr/local/sbin/slurm-gpu-suspend",
        "ResumeProgram": "/usr/local/sbin/slurm-gpu-resume",
        "SuspendTime": "1800", "SuspendTimeout": "180", "ResumeTimeout": "900"}
    # AWS keeps slurmctld's own 10 s scan; a health-drained node is never made idle again.
    assert keys["SlurmctldParameters"] == "enable_configless"
    local = dataclasses.replace(EC2, provider="local", interval=1)
    keys = conf_keys(render.render_slurm_conf(facts(local)))
    assert keys["SlurmctldParameters"] == "enable_configless,power_save_interval=1"  # one line: the last would win


def test_no_power_keys_when_nodes_never_stop():
    text = render.render_slurm_conf(facts(None))
    assert not re.search(r"^(Suspend|Resume)", text, re.M)
    assert node_layout.SUSPEND_PATH not in render.render_files(facts(None))
    assert node_layout.POWER_VENV not in user_data.bootstrap_script(facts(None), "controller")


def test_power_programs_only_on_the_controller():
    f = facts(EC2)
    programs = {node_layout.SUSPEND_PATH, node_layout.RESUME_PATH, node_layout.POWER_PATH}
    assert programs <= set(render.role_files(f, "controller"))
    assert not programs & set(render.role_files(f, "gpu"))
    assert node_layout.FILE_MODES[node_layout.SUSPEND_PATH] == 0o755  # slurmctld refuses group/world-writable


def test_slurmd_accepts_the_power_keys(tmp_path):
    """slurmd parses the whole file (as on a node) and reports its own hardware."""
    if not shutil.which("slurmd"):
        pytest.skip("slurmd not installed")
    conf = tmp_path / "slurm.conf"
    conf.write_text(render.render_slurm_conf(facts(EC2)))
    (tmp_path / "gres.conf").write_text("")
    res = subprocess.run(["slurmd", "-C", "-f", str(conf)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert "error" not in res.stderr.lower(), res.stderr


@pytest.mark.parametrize("bad", [
    {"suspend_time": 0}, {"resume_timeout": 0}, {"suspend_program": "slurm-gpu-suspend"},
    {"provider": "gcp"}, {"interval": 0},
])
def test_bad_power_facts_are_refused(bad):
    with pytest.raises(ValueError):
        render.render_slurm_conf(facts(dataclasses.replace(EC2, **bad)))


# ------------------------------------------------- the EC2 programs, botocore's Stubber

def load_program(tmp_path: Path, power_save: PowerSave = EC2, region: str | None = REGION):
    """The rendered program, imported as a module, logging into tmp_path."""
    path = tmp_path / "slurm-gpu-power"
    path.write_text(render.render_power_program(facts(power_save, region=region)))
    loader = importlib.machinery.SourceFileLoader("slurm_gpu_power", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    module.LOG = str(tmp_path / "power.log")
    return module


@pytest.fixture
def slurm_conf(tmp_path, monkeypatch):
    """The cluster's slurm.conf: the programs expand hostlists with the real scontrol."""
    if not shutil.which("scontrol"):
        pytest.skip("scontrol not installed")
    conf = tmp_path / "slurm.conf"
    conf.write_text(render.render_slurm_conf(facts(EC2)))
    monkeypatch.setenv("SLURM_CONF", str(conf))
    return conf


def ec2_client():
    import botocore.session

    return botocore.session.get_session().create_client(
        "ec2", region_name="ap-northeast-2", aws_access_key_id="test", aws_secret_access_key="test")


def described(*instances: tuple, stack: str = STACK) -> dict:
    """(id, Name tag, state[, stack tag]) each: DescribeInstances' answer."""
    return {"Reservations": [{"Instances": [
        {"InstanceId": i[0], "State": {"Name": i[2], "Code": 0},
         "Tags": [{"Key": "Name", "Value": i[1]}, {"Key": "Cluster", "Value": "mini"},
                  {"Key": STACK_TAG, "Value": i[3] if len(i) > 3 else stack}]}
        for i in instances]}]}


def filters(*names: str) -> list[dict]:
    return [{"Name": "tag:Cluster", "Values": ["mini"]}, {"Name": "tag:Role", "Values": ["gpu"]},
            {"Name": "tag:Name", "Values": list(names)}, {"Name": f"tag:{STACK_TAG}", "Values": [STACK]},
            {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}]


def changes(key: str, *ids: str) -> dict:
    return {key: [{"InstanceId": i, "PreviousState": {"Name": "running", "Code": 16},
                   "CurrentState": {"Name": "stopping", "Code": 64}} for i in ids]}


def test_suspend_stops_the_named_instances_of_this_cluster(tmp_path, slurm_conf):
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    with Stubber(ec2) as stub:
        stub.add_response("describe_instances", described(("i-0aaa", "mini-gpu-node-01", "running"),
                                                          ("i-0bbb", "mini-gpu-node-02", "stopping")),
                          {"Filters": filters("mini-gpu-node-01", "mini-gpu-node-02")})
        stub.add_response("stop_instances", changes("StoppingInstances", "i-0aaa", "i-0bbb"),
                          {"InstanceIds": ["i-0aaa", "i-0bbb"]})
        assert prog.main(["slurm-gpu-power", "suspend", "gpu-node-[01-02]"], ec2=ec2) == 0
        stub.assert_no_pending_responses()
    log = (tmp_path / "power.log").read_text()
    assert "suspend gpu-node-[01-02] (mini-gpu-node-01,mini-gpu-node-02)" in log
    assert "suspend requested for i-0aaa i-0bbb" in log


@pytest.mark.parametrize("action,call,key", [("suspend", "stop_instances", "StoppingInstances"),
                                             ("resume", "start_instances", "StartingInstances")])
def test_another_stacks_same_named_node_is_never_touched(tmp_path, slurm_conf, action, call, key):
    """Two stacks that keep the default clusterName "mini": both have an instance tagged Cluster=mini,
    Name=mini-gpu-node-01. The look-up asks for this stack's tag, and an answer that still holds the
    other's (listed first) leaves it alone: only ours is stopped or started."""
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    with Stubber(ec2) as stub:
        state = "running" if action == "suspend" else "stopped"
        stub.add_response("describe_instances",
                          described(("i-0ours", "mini-gpu-node-01", state),
                                    ("i-0theirs", "mini-gpu-node-01", state, "acme/slurm-gpu/dev")),
                          {"Filters": filters("mini-gpu-node-01")})
        stub.add_response(call, changes(key, "i-0ours"), {"InstanceIds": ["i-0ours"]})
        assert prog.main(["slurm-gpu-power", action, "gpu-node-01"], ec2=ec2) == 0
        stub.assert_no_pending_responses()
    assert "i-0theirs" not in (tmp_path / "power.log").read_text()


def test_resume_waits_for_a_stopping_instance_then_starts(tmp_path, slurm_conf):
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    with Stubber(ec2) as stub:
        stub.add_response("describe_instances", described(("i-0bbb", "mini-gpu-node-02", "stopping"),
                                                          ("i-0ccc", "mini-gpu-node-03", "stopped")),
                          {"Filters": filters("mini-gpu-node-02", "mini-gpu-node-03")})
        # The waiter's poll: the stopping one has stopped.
        stub.add_response("describe_instances", described(("i-0bbb", "mini-gpu-node-02", "stopped")),
                          {"InstanceIds": ["i-0bbb"]})
        stub.add_response("start_instances", changes("StartingInstances", "i-0bbb", "i-0ccc"),
                          {"InstanceIds": ["i-0bbb", "i-0ccc"]})
        assert prog.main(["slurm-gpu-power", "resume", "gpu-node-[02-03]"], ec2=ec2) == 0
        stub.assert_no_pending_responses()
    assert "waiting for i-0bbb to finish stopping" in (tmp_path / "power.log").read_text()


def test_unknown_hosts_are_logged_and_fail_when_none_is_found(tmp_path, slurm_conf):
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    with Stubber(ec2) as stub:
        stub.add_response("describe_instances", described(), {"Filters": filters("mini-gpu-node-07")})
        assert prog.main(["slurm-gpu-power", "suspend", "gpu-node-07"], ec2=ec2) == 1  # described, nothing stopped
        stub.assert_no_pending_responses()
    log = (tmp_path / "power.log").read_text()
    assert "no instance tagged Cluster=mini Role=gpu Name=mini-HOST slurm-gpu:stack=acme/slurm-gpu/prod for: gpu-node-07" in log
    assert prog.main(["slurm-gpu-power", "resume", ""], ec2=ec2) == 2
    assert "usage" in (tmp_path / "power.log").read_text()


def test_an_ec2_error_is_logged_not_raised(tmp_path, slurm_conf):
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    with Stubber(ec2) as stub:
        stub.add_client_error("describe_instances", "UnauthorizedOperation", "not authorized")
        assert prog.main(["slurm-gpu-power", "resume", "gpu-node-01"], ec2=ec2) == 1
    assert "failed: ClientError" in (tmp_path / "power.log").read_text()


RECORDING_SCONTROL = r"""#!/bin/bash
# Records `scontrol update ...` (no slurmctld here), one argument a line then a blank line, in CALLS;
# anything else is the real scontrol's (hostlists).
if [ "$1" = update ]; then printf '%s\n' "$@" '' >> CALLS; exit 0; fi
exec /usr/bin/scontrol "$@"
"""


@pytest.fixture
def start_failed(tmp_path):
    """A recording scontrol first on a loaded program's PATH; returns the `scontrol update` calls it
    made (each a list of arguments)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(RECORDING_SCONTROL.replace("CALLS", shlex.quote(str(calls))))
    (bin_dir / "scontrol").chmod(0o755)

    def install(prog):
        prog.PATH = f"{bin_dir}:/usr/bin:/bin"
        return lambda: [c.split("\n") for c in calls.read_text().split("\n\n") if c] if calls.exists() else []

    return install


ICE = "We currently do not have sufficient g6.12xlarge capacity in the Availability Zone you requested (ap-northeast-2a)."


def test_a_node_that_cannot_start_is_powered_down_at_once_with_the_ec2_error(tmp_path, slurm_conf, start_failed):
    """StartInstances of two nodes in the placement group fails for capacity: each is tried alone,
    the one that starts is left to boot, and Slurm is told at once of only the one that did not
    (not after ResumeTimeout), the EC2 error code and message as the reason."""
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    calls = start_failed(prog)
    with Stubber(ec2) as stub:
        stub.add_response("describe_instances", described(("i-0aaa", "mini-gpu-node-01", "stopped"),
                                                          ("i-0bbb", "mini-gpu-node-02", "stopped")),
                          {"Filters": filters("mini-gpu-node-01", "mini-gpu-node-02")})
        stub.add_client_error("start_instances", "InsufficientInstanceCapacity", ICE,
                              expected_params={"InstanceIds": ["i-0aaa", "i-0bbb"]})
        stub.add_response("start_instances", changes("StartingInstances", "i-0aaa"), {"InstanceIds": ["i-0aaa"]})
        stub.add_client_error("start_instances", "InsufficientInstanceCapacity", ICE,
                              expected_params={"InstanceIds": ["i-0bbb"]})
        assert prog.main(["slurm-gpu-power", "resume", "gpu-node-[01-02]"], ec2=ec2) == 1
        stub.assert_no_pending_responses()
    assert calls() == [["update", "nodename=gpu-node-02", "state=power_down_force",
                        f"reason=start failed: InsufficientInstanceCapacity: {ICE}"]]
    log = (tmp_path / "power.log").read_text()
    assert "resume requested for i-0aaa" in log
    assert f"could not start gpu-node-02: start failed: InsufficientInstanceCapacity: {ICE}" in log


def test_any_resume_error_tells_slurm_for_every_node_asked(tmp_path, slurm_conf, start_failed):
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    calls = start_failed(prog)
    with Stubber(ec2) as stub:
        stub.add_client_error("describe_instances", "UnauthorizedOperation", "not authorized")
        stub.add_response("describe_instances", described(), {"Filters": filters("mini-gpu-node-07")})
        assert prog.main(["slurm-gpu-power", "resume", "gpu-node-[01-02]"], ec2=ec2) == 1
        assert prog.main(["slurm-gpu-power", "resume", "gpu-node-07"], ec2=ec2) == 1  # no such instance
    (first, second) = calls()
    assert first == ["update", "nodename=gpu-node-[01-02]", "state=power_down_force",
                     "reason=start failed: UnauthorizedOperation: not authorized"]
    assert second[:3] == ["update", "nodename=gpu-node-07", "state=power_down_force"]
    assert second[3].startswith("reason=start failed: InstanceNotFound: no instance tagged Cluster=mini")
    # A failed stop is only logged: the node is not needed, Slurm powers it down after SuspendTimeout.
    with Stubber(ec2) as stub:
        stub.add_client_error("describe_instances", "UnauthorizedOperation", "not authorized")
        assert prog.main(["slurm-gpu-power", "suspend", "gpu-node-01"], ec2=ec2) == 1
    assert len(calls()) == 2


def test_the_start_failed_reason_is_one_bounded_line(tmp_path, start_failed):
    """Also the local cluster's programs' way in: `slurm-gpu-power start-failed HOST CODE MESSAGE`."""
    prog = load_program(tmp_path)
    calls = start_failed(prog)
    assert prog.main(["slurm-gpu-power", "start-failed", "gpu-node-01", "Weird",
                      "line one\nline two\t" + "x" * 500]) == 0
    ((*_, reason),) = calls()
    assert reason.startswith("reason=start failed: Weird: line one line two x")
    assert len(reason.removeprefix("reason=")) == node_layout.START_FAILED_MAX


def test_programs_run_from_their_own_venv_with_only_slurm_conf(tmp_path, slurm_conf):
    """Slurm execs its SuspendProgram/ResumeProgram with no PATH: each is a wrapper that runs the
    program by the power venv's python. Run as slurmctld would, with a venv that lacks boto3, it
    fails and says what to do."""
    venv = tmp_path / "venv"
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    program = tmp_path / "slurm-gpu-power"
    program.write_text(render.render_power_program(facts(EC2)).replace(
        repr(node_layout.POWER_LOG), repr(str(tmp_path / "power.log")), 1))
    for action in ("suspend", "resume"):
        wrapper = render.render_power_program(facts(EC2), action)
        exec_line = f"exec {node_layout.POWER_VENV}/bin/python3 {node_layout.POWER_PATH} {action} \"$@\""
        assert wrapper.startswith("#!/bin/sh\n") and exec_line in wrapper.splitlines()
        path = tmp_path / f"slurm-gpu-{action}"
        path.write_text(wrapper.replace(node_layout.POWER_VENV, str(venv)).replace(node_layout.POWER_PATH, str(program)))
        path.chmod(0o755)
        res = subprocess.run([str(path), "gpu-node-01"], env={"SLURM_CONF": str(slurm_conf)},
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 1, res.stderr
    log = (tmp_path / "power.log").read_text()
    assert log.count(f"boto3 is missing from {venv}/bin/python3; install it: sudo python3 -m venv {venv} && "
                     f"sudo {venv}/bin/python3 -m pip install {' '.join(node_pins.power_pins())}") == 2


def test_the_region_is_the_stacks_else_the_instance_metadatas(tmp_path, monkeypatch):
    import botocore.utils

    assert load_program(tmp_path).ec2_client().meta.region_name == "ap-northeast-2"
    # No region in the stack: botocore's IMDSv2 region look-up (answered here without a network).
    monkeypatch.setattr(botocore.utils.InstanceMetadataRegionFetcher, "retrieve_region", lambda self: "eu-west-1")
    no_region = load_program(tmp_path, EC2, region=None)
    assert no_region.REGION is None and no_region.ec2_client().meta.region_name == "eu-west-1"


# ------------------------------------------- the local programs, faked ssh

FAKE_SCONTROL = r"""#!/bin/bash
# scontrol show hostnames gpu-node-[01-02] -> one name a line (the form used here).
[ "$1 $2" = "show hostnames" ] || exit 1
case "$3" in
  'gpu-node-[01-02]') printf 'gpu-node-01\ngpu-node-02\n' ;;
  *) echo "$3" ;;
esac
"""
FAKE_SSH = r"""#!/bin/bash
# Records when the power command reaches each host: "EPOCH.NANOS HOST ACTION".
echo "$(date +%s.%N) ${*: -2}" >> "$FAKE_CALLS"
"""
LOCAL_POWER = Path(__file__).resolve().parents[2] / "localcluster" / "power.sh"


def run_local_power(tmp_path, name: str, hostlist: str):
    """localcluster/power.sh installed as `name`, its log in tmp_path, ssh and scontrol faked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, text in (("ssh", FAKE_SSH), ("scontrol", FAKE_SCONTROL),
                       (name, LOCAL_POWER.read_text().replace(
                           "LOG=/var/log/slurm/slurm-gpu-power.log", f"LOG={tmp_path}/power.log"))):
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_CALLS": str(tmp_path / "calls")}
    res = subprocess.run([str(bin_dir / name), hostlist], capture_output=True, text=True, env=env, timeout=30)
    calls = [ln.split() for ln in (tmp_path / "calls").read_text().splitlines()]
    return res, calls, (tmp_path / "power.log").read_text()


def test_local_power_on_reaches_hosts_in_a_later_second_than_the_request(tmp_path):
    # Slurm takes a powered-up node only if its boot (now - uptime, whole seconds) is not
    # before the request's second; the local "boot" (slurmd -b) can look a second old, so it
    # must come in a later second than the request. Begin just after a second starts, where
    # an immediate start would land in the request's own second.
    time.sleep(1 - time.time() % 1)
    requested = int(time.time())
    res, calls, log = run_local_power(tmp_path, "slurm-gpu-resume", "gpu-node-[01-02]")
    assert res.returncode == 0, log
    assert [c[1:] for c in calls] == [["gpu-node-01", "start"], ["gpu-node-02", "start"]]
    assert all(int(float(c[0])) > requested for c in calls), (requested, calls)
    assert "slurm-gpu-power: start gpu-node-[01-02]" in log


def test_power_programs_compile_and_the_bootstrap_passes_shellcheck(tmp_path):
    compile(render.render_power_program(facts(EC2)), "slurm-gpu-power", "exec")
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck not installed")
    ctl = tmp_path / "controller.sh"
    ctl.write_text(user_data.bootstrap_script(facts(EC2), "controller"))
    wrappers = []
    for action in ("suspend", "resume"):
        wrappers.append(tmp_path / action)
        wrappers[-1].write_text(render.render_power_program(facts(EC2), action))
    res = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", str(ctl), str(LOCAL_POWER)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
    res = subprocess.run(["shellcheck", "--shell=sh", "--severity=style", *map(str, wrappers)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


# ------------------------------------------------- the controller's power step

@pytest.fixture
def power_step(tmp_path, monkeypatch):
    """The controller bootstrap with only its `power` step, its venv and state under tmp_path."""
    for name in ("STATE_DIR", "STEPS_DIR", "MARKER_PATH", "VERSION_PATH"):
        monkeypatch.setattr(render, name, str(tmp_path / "state" / name.lower()))
    monkeypatch.setattr(render, "POWER_VENV", str(tmp_path / "power"))

    def run(power_save=EC2):
        script = tmp_path / "bootstrap-controller"
        script.write_text(user_data.bootstrap_script(facts(power_save), "controller"))
        skip = " ".join(s for s in node_layout.STEPS["controller"] if s != "power")
        return subprocess.run(["bash", str(script)], env={**os.environ, "SLURM_GPU_SKIP_STEPS": skip},
                              capture_output=True, text=True, timeout=600)

    return run, tmp_path / "power"


def test_controller_power_step_fails_by_name_when_boto3_is_missing(power_step):
    run, venv = power_step
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (venv / ".slurm-gpu-pins").write_text(" ".join(node_pins.power_pins()) + "\n")  # pins recorded, boto3 gone
    res = run()
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert f"power saving: boto3 is missing from {venv}, so Slurm cannot start or stop GPU nodes" in out
    assert 'step "power" failed' in out


def test_controller_power_step_installs_nothing_without_ec2_power_saving(power_step):
    run, venv = power_step
    res = run(None)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no EC2 power saving here" in res.stdout and not venv.exists()


@pytest.mark.slow
def test_controller_power_step_installs_the_pinned_boto3(power_step):
    """For real: a venv of this machine's python3 and pip from the configured index."""
    run, venv = power_step
    res = run()
    assert res.returncode == 0, res.stdout + res.stderr
    pins = dict(p.split("==") for p in node_pins.power_pins())
    assert f"power saving: boto3 {pins['boto3']} in {venv}" in res.stdout
    got = subprocess.run([str(venv / "bin/python3"), "-c", "import botocore; print(botocore.__version__)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert got == pins["botocore"]
    assert run().returncode == 0  # again: pins recorded, nothing reinstalled


# ------------------------------------------------- the role, mocked program

def _stop_start_statement(doc: dict) -> dict:
    (st,) = [s for s in doc["Statement"] if "ec2:StopInstances" in s["Action"]]
    return st


def test_controller_role_may_stop_and_start_only_this_clusters_gpu_nodes():
    run = harness.run_program(stack_config(clusterName="research"))
    (role,) = run.of_type("role")
    (policy,) = run.of_type("role_policy")
    (profile,) = run.of_type("instance_profile")
    assume = json.loads(role.inputs["assumeRolePolicy"])
    assert assume["Statement"] == [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
                                    "Action": "sts:AssumeRole"}]
    assert policy.inputs["role"] == f"{role.name}-id"
    doc = json.loads(policy.inputs["policy"])
    assert len(doc["Statement"]) == 2
    st = _stop_start_statement(doc)
    assert st["Effect"] == "Allow"
    assert sorted(st["Action"]) == ["ec2:StartInstances", "ec2:StopInstances"]
    assert st["Resource"] == "arn:aws:ec2:ap-northeast-2:*:instance/*"
    # This stack's nodes only: another stack may use the same cluster name (its own stack tag).
    assert st["Condition"] == {"StringEquals": {"aws:ResourceTag/Cluster": "research",
                                                "aws:ResourceTag/Role": "gpu",
                                                "aws:ResourceTag/slurm-gpu:stack": "slurm-gpu/test"}}
    (describe,) = [s for s in doc["Statement"] if s is not st]
    assert describe == {"Sid": "FindInstances", "Effect": "Allow", "Action": "ec2:DescribeInstances",
                        "Resource": "*"}
    # Only the controller wears the profile; GPU nodes carry exactly the tags the condition names.
    instances = run.of_type("instance")
    ctl = [i for i in instances if i.inputs["tags"]["Role"] == "controller"]
    gpus = [i for i in instances if i.inputs["tags"]["Role"] == "gpu"]
    assert [i.inputs.get("iamInstanceProfile") for i in ctl] == [f"{profile.name}-5e6f7a"]  # its name
    assert all(not i.inputs.get("iamInstanceProfile") for i in gpus)
    assert all(i.inputs["tags"]["Cluster"] == "research" for i in gpus)
    assert all(i.inputs["tags"]["slurm-gpu:stack"] == "slurm-gpu/test" for i in gpus)
    # The inventory tells fab the idle stop and how long a start takes.
    inv = run.outputs["inventory"]
    power_save = Inventory.from_dict(inv).facts.power_save
    assert (power_save.suspend_time, power_save.resume_timeout) == (1800, 900)


def test_idle_stop_0_declares_no_role_and_no_power_keys():
    run = harness.run_program(stack_config(idleStopMinutes=0))
    assert not run.of_type("role") and not run.of_type("role_policy") and not run.of_type("instance_profile")
    assert all(not i.inputs.get("iamInstanceProfile") for i in run.of_type("instance"))
    assert Inventory.from_dict(run.outputs["inventory"]).idle_stop_s is None


# ------------------------------------------------- sinfo power flags

@pytest.mark.parametrize("state,want", [
    ("idle", "on"), ("idle*", "on"), ("mixed", "on"), ("idle~", "stopped"), ("down~", "stopped"),
    ("idle#", "starting"), ("mixed#", "starting"), ("idle%", "stopping"), ("idle!", "stopping soon"),
    ("", "on"),
])
def test_power_state_from_sinfo(state, want):
    assert power.power_state(state) == want


def test_a_failed_start_is_read_from_the_reason_with_what_to_do():
    ice = "start failed: InsufficientInstanceCapacity: We currently do not have sufficient capacity"
    assert power.start_failure(slurm.NodeState("gpu-node-01", "idle~", ice)) == ice
    assert power.start_failure(slurm.NodeState("gpu-node-01", "idle%", ice)) == ice
    assert power.start_failure(slurm.NodeState("gpu-node-01", "idle", ice)) is None  # it started since
    assert power.start_failure(slurm.NodeState("gpu-node-01", "drained~", "health check")) is None
    advice = power.advice(ice)
    assert "Wait and retry" in advice and "the next job that needs it" in advice
    assert "slurm-gpu:availabilityZone" in advice and "describe-instance-type-offerings" in advice
    assert "Capacity Reservation" in advice and "--placement-group-arn" in advice
    other = power.advice("start failed: UnauthorizedOperation: not authorized")
    assert "Availability Zone" not in other and node_layout.POWER_LOG in other


def test_the_line_fab_train_prints_for_a_stopped_node():
    assert power.describe("gpu-node-02", "stopped", "~2-4 minutes") == \
        "gpu-node-02 is stopped (idle power-save); Slurm is starting it, ~2-4 minutes"


def test_a_spot_node_started_right_after_its_stop_is_retried_while_its_request_settles(
        tmp_path, slurm_conf, start_failed):
    """IncorrectSpotRequestState right after an idle stop (the persistent request moving to disabled:
    terraform-provider-aws#33399) is retried with backoff within half of ResumeTimeout; the node then
    starts and Slurm is told nothing."""
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    calls, waits = start_failed(prog), []
    prog.SLEEP = waits.append
    settling = "The spot instance request is in an incorrect state for this operation."
    with Stubber(ec2) as stub:
        stub.add_response("describe_instances", described(("i-0aaa", "mini-gpu-node-01", "stopped")),
                          {"Filters": filters("mini-gpu-node-01")})
        for _ in range(2):  # the batch call, then the instance alone: both while the request settles
            stub.add_client_error("start_instances", "IncorrectSpotRequestState", settling,
                                  expected_params={"InstanceIds": ["i-0aaa"]})
        stub.add_response("start_instances", changes("StartingInstances", "i-0aaa"), {"InstanceIds": ["i-0aaa"]})
        assert prog.main(["slurm-gpu-power", "resume", "gpu-node-01"], ec2=ec2) == 0
        stub.assert_no_pending_responses()
    assert calls() == [] and waits == [5]
    assert sum(prog.RETRY_WAITS) <= EC2.resume_timeout // 2 and len(prog.RETRY_WAITS) > 3
    assert "resume requested for i-0aaa" in (tmp_path / "power.log").read_text()


def test_a_spot_request_that_never_settles_is_handed_to_slurm_after_the_retries(tmp_path, slurm_conf, start_failed):
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    calls, waits = start_failed(prog), []
    prog.SLEEP = waits.append
    with Stubber(ec2) as stub:
        stub.add_response("describe_instances", described(("i-0aaa", "mini-gpu-node-01", "stopped")),
                          {"Filters": filters("mini-gpu-node-01")})
        for _ in range(len(prog.RETRY_WAITS) + 2):
            stub.add_client_error("start_instances", "IncorrectSpotRequestState", "cancelled")
        assert prog.main(["slurm-gpu-power", "resume", "gpu-node-01"], ec2=ec2) == 1
        stub.assert_no_pending_responses()
    assert waits == prog.RETRY_WAITS
    assert calls() == [["update", "nodename=gpu-node-01", "state=power_down_force",
                        "reason=start failed: IncorrectSpotRequestState: cancelled"]]


THREE = (("i-0aaa", "mini-gpu-node-01", "stopped"), ("i-0bbb", "mini-gpu-node-02", "stopped"),
         ("i-0ccc", "mini-gpu-node-03", "stopped"))


def fake_time(prog) -> list[float]:
    """The program's clock advanced only by its sleeps; returns the waits it slept."""
    now, waits = [1000.0], []

    def sleep(s):
        waits.append(s)
        now[0] += s

    prog.SLEEP, prog.CLOCK = sleep, lambda: now[0]
    return waits


def _three_refused(stub, ids, rounds: int, message: str) -> None:
    """THREE described, their batch start refused, then `rounds` rounds of each one refused on its own."""
    stub.add_response("describe_instances", described(*THREE), {"Filters": filters(*(i[1] for i in THREE))})
    stub.add_client_error("start_instances", "IncorrectSpotRequestState", message,
                          expected_params={"InstanceIds": ids})
    for _ in range(rounds):
        for i in ids:
            stub.add_client_error("start_instances", "IncorrectSpotRequestState", message,
                                  expected_params={"InstanceIds": [i]})


def test_three_settling_spot_nodes_are_retried_together_and_all_start_within_the_budget(
        tmp_path, slurm_conf, start_failed):
    """Each round tries every node still refused, so three nodes cost the waits of one: retried one node
    after another, the second and third would wait behind the first's whole budget."""
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    calls, waits = start_failed(prog), fake_time(prog)
    ids = [i[0] for i in THREE]
    with Stubber(ec2) as stub:
        _three_refused(stub, ids, rounds=4, message="settling")  # four rounds of all three refused
        for i in ids:
            stub.add_response("start_instances", changes("StartingInstances", i), {"InstanceIds": [i]})
        assert prog.main(["slurm-gpu-power", "resume", "gpu-node-[01-03]"], ec2=ec2) == 0
        stub.assert_no_pending_responses()
    assert calls() == [] and waits == prog.RETRY_WAITS[:4]
    assert sum(waits) <= prog.BUDGET_S == EC2.resume_timeout // 2


def test_three_spot_nodes_that_never_settle_are_handed_to_slurm_within_the_budget(
        tmp_path, slurm_conf, start_failed):
    """One deadline for the whole resume call, a slow wait for stopping instances included."""
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    calls, waits = start_failed(prog), fake_time(prog)
    ids = [i[0] for i in THREE]
    with Stubber(ec2) as stub:
        _three_refused(stub, ids, rounds=len(prog.RETRY_WAITS) + 1, message="cancelled")
        assert prog.main(["slurm-gpu-power", "resume", "gpu-node-[01-03]"], ec2=ec2) == 1
        stub.assert_no_pending_responses()
    assert sum(waits) <= prog.BUDGET_S
    assert calls() == [["update", "nodename=gpu-node-01,gpu-node-02,gpu-node-03", "state=power_down_force",
                        "reason=start failed: IncorrectSpotRequestState: cancelled"]]


def test_the_wait_for_a_stopping_node_counts_against_the_same_budget(tmp_path, slurm_conf, start_failed):
    """The wait for "stopped" is bounded by the deadline, and what it took leaves less for the retries."""
    from botocore.stub import Stubber

    prog, ec2 = load_program(tmp_path), ec2_client()
    calls, waits = start_failed(prog), fake_time(prog)
    polls = []

    class SlowWaiter:
        def wait(self, InstanceIds, WaiterConfig):
            polls.append(WaiterConfig)
            prog.SLEEP(prog.BUDGET_S - 10)  # stopped at last, late

    ec2.get_waiter = lambda name: SlowWaiter()
    with Stubber(ec2) as stub:
        stub.add_response("describe_instances", described(("i-0aaa", "mini-gpu-node-01", "stopping")),
                          {"Filters": filters("mini-gpu-node-01")})
        for _ in range(3):  # the batch, then two rounds alone; 5 s fits in what is left, 10 s does not
            stub.add_client_error("start_instances", "IncorrectSpotRequestState", "settling",
                                  expected_params={"InstanceIds": ["i-0aaa"]})
        assert prog.main(["slurm-gpu-power", "resume", "gpu-node-01"], ec2=ec2) == 1
        stub.assert_no_pending_responses()
    assert polls == [{"Delay": 15, "MaxAttempts": prog.BUDGET_S // 15}]
    assert waits == [prog.BUDGET_S - 10, 5] and sum(waits) <= prog.BUDGET_S
    assert calls()[0][:3] == ["update", "nodename=gpu-node-01", "state=power_down_force"]
