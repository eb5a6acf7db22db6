"""Idle GPU nodes stop paying: the setting, slurm.conf, the EC2 power programs (run with a
fake `aws` and `scontrol`), the controller's tag-scoped role in the mocked program, and
the sinfo power flags fab reads. The local cluster's real run is test_power_save_cluster.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import tests.test_infra_mocks as harness
from bootstrap import render
from bootstrap.facts import ClusterFacts, NodeShape, PowerSave, plan_hosts
from infra.config import ConfigError, StackConfig
from ops import power
from tests.test_infra_mocks import stack_config

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

def facts(power_save: PowerSave | None, cluster: str = "mini") -> ClusterFacts:
    ctl, nodes = plan_hosts("10.0.1.0/24", 3)
    return ClusterFacts(cluster, ctl, nodes, NodeShape(48, 184800, 4, "l4"), "10.0.1.0/24",
                        power_save=power_save)


EC2 = PowerSave(suspend_time=1800, suspend_program="/usr/local/sbin/slurm-gpu-suspend",
                resume_program="/usr/local/sbin/slurm-gpu-resume", suspend_timeout=180,
                resume_timeout=900, provider="ec2", region="ap-northeast-2")


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
    assert render.SUSPEND_PATH not in render.render_files(facts(None))


def test_power_programs_only_on_the_controller():
    f = facts(EC2)
    assert {render.SUSPEND_PATH, render.RESUME_PATH} <= set(render.role_files(f, "controller"))
    assert not {render.SUSPEND_PATH, render.RESUME_PATH} & set(render.role_files(f, "gpu"))
    assert render.FILE_MODES[render.SUSPEND_PATH] == 0o755  # slurmctld refuses group/world-writable


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


# ------------------------------------------------- the EC2 programs, faked aws

FAKE_AWS = r"""#!/bin/bash
# Records its arguments; answers describe-instances from $FAKE_DESCRIBE.
printf '%s\n' "$*" >> "$FAKE_CALLS"
case "$2" in
  describe-instances) cat "$FAKE_DESCRIBE" ;;
  stop-instances|start-instances) echo "i-x running stopping" ;;
  wait) echo waited ;;
esac
"""
FAKE_SCONTROL = r"""#!/bin/bash
# scontrol show hostnames gpu-node-[01-03] -> one name a line (the forms used here).
[ "$1 $2" = "show hostnames" ] || exit 1
case "$3" in
  'gpu-node-[01-02]') printf 'gpu-node-01\ngpu-node-02\n' ;;
  'gpu-node-[02-03]') printf 'gpu-node-02\ngpu-node-03\n' ;;
  *) echo "$3" ;;
esac
"""


@pytest.fixture
def ec2_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("aws", FAKE_AWS), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "power.log"

    def run(action: str, hostlist: str, describe: str):
        script = render.render_power_program(facts(EC2), action)
        # The script as rendered, with its log and PATH pointed into tmp_path.
        script = script.replace(f"LOG='{render.POWER_LOG}'", f"LOG='{log}'")
        script = script.replace("export PATH=", f"export PATH={bin_dir}:")
        path = tmp_path / f"slurm-gpu-{action}"
        path.write_text(script)
        path.chmod(0o755)
        (tmp_path / "describe.txt").write_text(describe)
        env = {**os.environ, "FAKE_CALLS": str(tmp_path / "calls"), "FAKE_DESCRIBE": str(tmp_path / "describe.txt")}
        res = subprocess.run([str(path), hostlist], capture_output=True, text=True, env=env, timeout=30)
        calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
        return res, calls, log.read_text() if log.exists() else ""

    return run


DESCRIBED = ("i-0aaa\tmini-gpu-node-01\trunning\n"
             "i-0bbb\tmini-gpu-node-02\tstopping\n"
             "i-0ccc\tmini-gpu-node-03\tstopped\n")


def test_suspend_stops_the_named_instances_of_this_cluster(ec2_env):
    res, calls, log = ec2_env("suspend", "gpu-node-[01-02]", DESCRIBED)
    assert res.returncode == 0, log
    describe, stop = calls
    assert describe.startswith("ec2 describe-instances --region ap-northeast-2")
    assert "Name=tag:Cluster,Values=mini Name=tag:Role,Values=gpu " \
           "Name=tag:Name,Values=mini-gpu-node-01,mini-gpu-node-02" in describe
    assert stop.startswith("ec2 stop-instances --region ap-northeast-2 --instance-ids i-0aaa i-0bbb ")
    assert "suspend gpu-node-[01-02] (mini-gpu-node-01,mini-gpu-node-02)" in log
    assert res.stdout == res.stderr == ""  # everything goes to the log


def test_resume_waits_for_a_stopping_instance_then_starts(ec2_env):
    res, calls, log = ec2_env("resume", "gpu-node-[02-03]", DESCRIBED)
    assert res.returncode == 0, log
    assert calls[1] == "ec2 wait instance-stopped --region ap-northeast-2 --instance-ids i-0bbb"
    assert calls[2].startswith("ec2 start-instances --region ap-northeast-2 --instance-ids i-0bbb i-0ccc ")
    assert "waiting for i-0bbb to finish stopping" in log


def test_unknown_hosts_are_logged_and_fail_when_none_is_found(ec2_env):
    res, calls, log = ec2_env("suspend", "gpu-node-07", DESCRIBED)
    assert res.returncode == 1
    assert len(calls) == 1  # described, nothing stopped
    assert "no instance tagged Cluster=mini Role=gpu Name=mini-HOST for: gpu-node-07" in log
    res, calls, log = ec2_env("resume", "", DESCRIBED)
    assert res.returncode == 2 and "usage" in log


# ------------------------------------------- the local programs, faked ssh

FAKE_SSH = r"""#!/bin/bash
# Records when the power command reaches each host: "EPOCH.NANOS HOST ACTION".
echo "$(date +%s.%N) ${*: -2}" >> "$FAKE_CALLS"
"""
LOCAL_POWER = Path(__file__).resolve().parent.parent / "localcluster" / "power.sh"


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


def test_power_programs_pass_shellcheck(tmp_path):
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck not installed")
    paths = []
    for action in ("suspend", "resume"):
        p = tmp_path / f"{action}.sh"
        p.write_text(render.render_power_program(facts(EC2), action))
        paths.append(str(p))
    res = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", *paths, str(LOCAL_POWER)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


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
    assert st["Condition"] == {"StringEquals": {"aws:ResourceTag/Cluster": "research",
                                                "aws:ResourceTag/Role": "gpu"}}
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
    # The inventory tells fab the idle stop and how long a start takes.
    inv = run.outputs["inventory"]
    assert inv["extra"]["idle_stop_s"] == 1800 and inv["extra"]["resume_timeout_s"] == 900


def test_idle_stop_0_declares_no_role_and_no_power_keys():
    run = harness.run_program(stack_config(idleStopMinutes=0))
    assert not run.of_type("role") and not run.of_type("role_policy") and not run.of_type("instance_profile")
    assert all(not i.inputs.get("iamInstanceProfile") for i in run.of_type("instance"))
    assert "idle_stop_s" not in run.outputs["inventory"]["extra"]


# ------------------------------------------------- sinfo power flags

@pytest.mark.parametrize("state,want", [
    ("idle", "on"), ("idle*", "on"), ("mixed", "on"), ("idle~", "stopped"), ("down~", "stopped"),
    ("idle#", "starting"), ("mixed#", "starting"), ("idle%", "stopping"), ("idle!", "stopping soon"),
    ("", "on"),
])
def test_power_state_from_sinfo(state, want):
    assert power.power_state(state) == want


def test_the_line_fab_train_prints_for_a_stopped_node():
    assert power.describe("gpu-node-02", "stopped", "~2-4 minutes") == \
        "gpu-node-02 is stopped (idle power-save); Slurm is starting it, ~2-4 minutes"
