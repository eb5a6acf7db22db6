"""Every `fab` task with no cluster and with each flag given a wrong value.

Each case: exit 1 (or, for `fab local.down`, a clear "nothing to stop"), one message naming the
setting or the missing cluster and the fix, no traceback, nothing made on this machine. One `fab`
subprocess per task for the no-cluster state (the real CLI path); the flag values go through the
tasks themselves, in process, where they are refused before any host is contacted. The states
that need a cluster (slurmctld down, a node's sshd down) are in tests/cluster/test_faults_cluster.py.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from fabric import Config
from invoke import Context
from invoke.exceptions import Exit

import fabfile
from tests.unit.test_bad_input import FAB, REPO, _all_in, _host_state, _made, no_cluster  # noqa: F401

NO_LOCAL = ["no local cluster", "Start one with `fab local.up`"]

# (argv, expected rc, expected substrings): every task with no local cluster at all.
NO_CLUSTER = [
    (["status", "--target", "local"], 1, NO_LOCAL),
    (["logs", "--target", "local"], 1, NO_LOCAL),
    (["cancel", "--target", "local", "--job", "7"], 1, NO_LOCAL),
    (["reconfigure", "--target", "local"], 1, NO_LOCAL),
    (["ssh", "gpu-node-01", "--target", "local", "--command", "true"], 1, NO_LOCAL),
    (["local.status"], 1, ["no local cluster (start one with `fab local.up`)"]),
    # idempotent on purpose (`fab local.down && fab local.up` is the repair), but it says so
    (["local.down"], 0, ["no local cluster was up: nothing to stop"]),
]


@pytest.mark.parametrize("argv,rc,expected", NO_CLUSTER, ids=[" ".join(a) for a, _r, _e in NO_CLUSTER])
def test_every_task_with_no_cluster(no_cluster, argv, rc, expected):  # noqa: F811
    before = _host_state()
    res = subprocess.run([FAB, *argv], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SLURM_GPU_RUNS": "/nonexistent-runs"})
    out = res.stdout + res.stderr
    assert res.returncode == rc, out
    _all_in(out, expected)
    assert "Traceback" not in out, out
    assert _made(before, _host_state()) == {}


TARGET = ["--target must be 'aws'", "or 'local'", "not 'nowhere'"]
JOB = ["--job must be a Slurm job id (a number)", "see `fab status`"]
IDENTITY = ["--identity /nonexistent/id_ed25519: no readable key file", "pass the private key"]
STACK = ["--stack names a Pulumi stack", "only goes with --target aws"]
TASKS = {"status": {}, "logs": {}, "cancel": {}, "reconfigure": {}, "update_nodes": {}, "ssh": {"host": "controller"},
         "train": {}}

# (task, kwargs, expected substrings): wrong flag values, refused before any host is contacted.
FLAGS = [(name, {**base, "target": "nowhere"}, TARGET) for name, base in TASKS.items()]
FLAGS += [(name, {**base, "target": "local", "identity": "/nonexistent/id_ed25519"}, IDENTITY)
          for name, base in TASKS.items()]
FLAGS += [(name, {**base, "target": "local", "stack": "dev"}, STACK) for name, base in TASKS.items()]
FLAGS += [(name, {"target": "local", "job": job}, JOB + [repr(job.strip())])
          for name in ("logs", "cancel") for job in ("abc", "-1", "0", "1.5", " ")]
FLAGS += [
    ("train", {"target": "local", "examples": "0"}, ["--examples must be at least 1, not 0"]),
    ("train", {"target": "local", "examples": "-3"}, ["--examples must be at least 1, not -3"]),
    ("train", {"target": "local", "examples": "x"}, ["--examples must be a whole number, not 'x'"]),
    ("train", {"target": "local", "nodes": "x"}, ["--nodes must be a whole number, not 'x'"]),
    ("train", {"target": "local", "gpus_per_node": "0"}, ["--gpus-per-node must be at least 1, not 0"]),
    ("train", {"target": "local", "max_cost": "-5"}, ["--max-cost must be a positive number of US dollars", "'-5'"]),
    ("train", {"target": "local", "max_cost": "0"}, ["--max-cost must be a positive number of US dollars", "'0'"]),
    ("train", {"target": "local", "max_cost": "nan"}, ["--max-cost must be a number of US dollars", "'nan'"]),
    ("train", {"target": "local", "max_cost": "ten"}, ["--max-cost must be a number of US dollars", "'ten'"]),
    # Numbers are ASCII digits and finite: Python's int()/float() take '٣' (Arabic-Indic 3), 'nan', 'inf'.
    ("train", {"target": "local", "nodes": "٣"}, ["--nodes must be a whole number, not '٣'", "digits 0-9"]),
    ("train", {"target": "local", "examples": "١٠"}, ["--examples must be a whole number, not '١٠'"]),
    ("train", {"target": "local", "max_cost": "٥"}, ["--max-cost must be a number of US dollars", "'٥'"]),
    ("train", {"target": "local", "max_cost": "inf"}, ["--max-cost must be a number of US dollars", "'inf'"]),
    ("logs", {"target": "local", "job": "٣"}, JOB + ["'٣'"]),
    *[("estimate", {"target": "aws", "gpu_instance_type": "g6.12xlarge", "region": "us-east-1", flag: value},
       [f"--{flag.replace('_', '-')} must be a number, not {value!r}"])
      for flag in ("scratch_mbps", "model_gb", "tokens_per_row") for value in ("nan", "inf", "-inf", "٣", "1e999")],
    ("ssh", {"host": "", "target": "local"}, ["name the host", "`fab ssh controller`"]),
    ("ssh", {"host": "   ", "target": "nowhere"}, ["name the host", "`fab ssh gpu-node-01`"]),
]


@pytest.mark.parametrize("task,kwargs,expected", FLAGS, ids=[f"{t} {k}" for t, k, _e in FLAGS])
def test_wrong_flag_values_are_refused_before_any_host(task, kwargs, expected):
    with pytest.raises(Exit) as info:
        getattr(fabfile, task)(Context(config=Config()), **kwargs)
    assert info.value.code == 1
    _all_in(str(info.value.message), [f"fab {task}: ", *expected])
