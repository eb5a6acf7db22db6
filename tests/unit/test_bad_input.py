"""Bad input, table-driven: stack config, `fab` options, data files, local-cluster options.

Each row is (kind, input, expected substrings): the substrings name the setting or flag AND
a hint of the fix. Beyond the message, each kind checks that nothing was half-made:
- stack config: the program under mocks declared no resource and no component;
- `fab ...` as a subprocess: no network namespace, bridge, cluster state or daemon appeared
  (listed before and after, under the local-cluster lock so no cluster comes or goes meanwhile);
- data files: training's own entry point fails before anything is written to its output_dir.
`fab train` with a bad data file on a running cluster (no job directory left on /scratch) is in
tests/cluster/test_healthcheck_cluster.py, which has a cluster up.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cluster.stack_config import ConfigError, StackConfig
from localcluster import lifecycle as cluster
from localcluster import plan
from localcluster import topology as layout
from ops.actions import options
from tests.support.local_cluster import cluster_lock
from tests.support.pulumi_mocks import ADMIN_CIDR, SSH_KEY, ClusterMocks, run_program, stack_config
from training.data import DataError, load_local_rows

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
DAEMONS = {"slurmd", "slurmctld", "munged", "sshd"}
GOOD = {"adminCidr": ADMIN_CIDR, "sshPublicKey": SSH_KEY}
FIX = "`pulumi config set slurm-gpu:"

# ------------------------------------------------------------------ the table

# Stack config through StackConfig.from_mapping: (overrides, expected substrings).
CONFIG = [
    ({"adminCidr": None}, ["slurm-gpu:adminCidr is required", FIX + "adminCidr"]),
    ({"adminCidr": "0.0.0.0/0"}, ["slurm-gpu:adminCidr", FIX + "adminCidr"]),
    ({"adminCidr": "203.0.113.300/32"}, ["slurm-gpu:adminCidr", FIX + "adminCidr"]),
    ({"adminCidr": "10.0.0.0/8"}, ["slurm-gpu:adminCidr (10.0.0.0/8) would open SSH to a range wider than a /16",
                                   FIX + "allowWideAdminCidr true`", FIX + "adminCidr 203.0.113.7/32`"]),
    ({"adminCidr": "198.18.0.0/15"}, ["slurm-gpu:adminCidr (198.18.0.0/15) would open SSH", "allowWideAdminCidr"]),
    ({"adminCidr": "0.0.0.0/0"}, ["(0.0.0.0/0) would open SSH to the whole internet", "allowWideAdminCidr true`"]),
    ({"adminCidr": "127.0.0.1/32"}, ["slurm-gpu:adminCidr (127.0.0.1/32) is a loopback range", FIX + "adminCidr"]),
    ({"adminCidr": "127.0.0.0/8", "allowWideAdminCidr": "true"}, ["(127.0.0.0/8) is a loopback range"]),
    ({"adminCidr": "169.254.169.254/32"}, ["(169.254.169.254/32) is a link-local range", FIX + "adminCidr"]),
    ({"adminCidr": "169.254.0.0/16"}, ["(169.254.0.0/16) is a link-local range"]),
    ({"adminCidr": "::1/128"}, ["slurm-gpu:adminCidr (::1/128) is a loopback range"]),
    ({"adminCidr": "fe80::/10", "allowWideAdminCidr": "true"}, ["(fe80::/10) is a link-local range"]),
    ({"adminCidr": "203.0.113.7/32", "allowWideAdminCidr": "yes"},
     ["slurm-gpu:allowWideAdminCidr must be true or false", FIX + "allowWideAdminCidr true`"]),
    ({"gpuNodeCount": "٣"}, ["slurm-gpu:gpuNodeCount must be a whole number, not '٣'", FIX + "gpuNodeCount 2`"]),
    ({"sshPublicKey": "-----BEGIN OPENSSH PRIVATE KEY-----"}, ["slurm-gpu:sshPublicKey", FIX + "sshPublicKey"]),
    ({"gpuNodeCount": "0"}, ["slurm-gpu:gpuNodeCount must be at least 1", FIX + "gpuNodeCount 2`"]),
    ({"gpuNodeCount": "two"}, ["slurm-gpu:gpuNodeCount", FIX + "gpuNodeCount"]),
    ({"rootVolumeGiB": "10"}, ["slurm-gpu:rootVolumeGiB is 10 GiB", FIX + "rootVolumeGiB 200`"]),
    ({"subnetCidr": "10.9.0.0/24"}, ["slurm-gpu:subnetCidr (10.9.0.0/24) is not inside", FIX + "subnetCidr"]),
    ({"clusterName": "My Cluster"}, ["slurm-gpu:clusterName", FIX + "clusterName mini`"]),
    ({"efa": "maybe"}, ["slurm-gpu:efa", FIX + "efa"]),
    ({"adminCdir": "203.0.113.7/32"}, ["unknown setting slurm-gpu:adminCdir", "`pulumi config rm slurm-gpu:adminCdir`"]),
]

# Stack config the whole program refuses (needs the provider's answers): run under mocks.
PROGRAM = [
    ({"gpuInstanceType": "c6i.xlarge"}, ["slurm-gpu:gpuInstanceType is c6i.xlarge, which has no GPU",
                                         FIX + "gpuInstanceType g6.12xlarge`"]),
    ({"gpuInstanceType": "g4dn.xlarge"}, ["slurm-gpu:gpuInstanceType is g4dn.xlarge, which does not support EFA",
                                          FIX + "efa false`"]),
    ({"gpuInstanceType": "g9.huge"}, ["slurm-gpu:gpuInstanceType is g9.huge, which this region does not offer",
                                      FIX + "gpuInstanceType g6.12xlarge`"]),
]

# `fab` run for real: (argv, expected substrings).
FAB_CLI = [
    (["train", "--target", "gcp"], ["--target must be 'aws'", "or 'local'"]),
    (["train", "--target", "local", "--nodes", "0"], ["--nodes must be at least 1"]),
    (["train", "--target", "local", "--model", "Qwen/Qwen3-4B"],
     ["--model 'Qwen/Qwen3-4B'", "give an absolute path visible on the cluster"]),
    (["train", "--target", "local", "--config", "/nonexistent/train.yaml"],
     ["--config /nonexistent/train.yaml: no such file", "pass a YAML file such as"]),
    (["logs", "--target", "local", "--job", "abc"], ["--job must be a Slurm job id", "see `fab status`"]),
    (["train", "--target", "local", "--down"], ["--down: the local cluster is not a Pulumi stack", "`fab local.down`"]),
    (["down", "--target", "local"], ["fab down: the local cluster is not a Pulumi stack", "`fab local.down`"]),
    (["local.up", "--nodes", "0"], ["--nodes must be a whole number from 1 to 20", "`fab local.up --nodes 2`"]),
    (["local.up", "--nodes", "-1"], ["--nodes must be a whole number from 1 to 20", "`fab local.up --nodes 2`"]),
    (["local.up", "--nodes", "abc"], ["--nodes must be a whole number from 1 to 20 (got 'abc')"]),
    (["local.up", "--nodes", "21"], ["--nodes must be a whole number from 1 to 20", "`fab local.up --nodes 2`"]),
    (["local.up", "--gpus", "0"], ["--gpus must be a whole number from 1 to 8", "`fab local.up --gpus 2`"]),
    (["local.up", "--gpus", "9"], ["--gpus must be a whole number from 1 to 8", "`fab local.up --gpus 2`"]),
]

# `fab train` options through the validator: (kwargs of options.parse, expected substrings).
OPTIONS = [
    ({"target": "local", "examples": "ten"}, ["--examples must be a whole number, not 'ten'"]),
    ({"target": "local", "gpus_per_node": "-2"}, ["--gpus-per-node must be at least 1, not -2"]),
    ({"target": "local", "stack": "dev"}, ["--stack names a Pulumi stack", "only goes with --target aws"]),
    ({"target": "aws", "identity": "/nonexistent/id_ed25519"},
     ["--identity /nonexistent/id_ed25519: no readable key file", "pass the private key"]),
    ({"target": "aws", "data": "my data.jsonl"}, ["--data my data.jsonl: no such file on this machine",
                                                  "a Hub data set ID or an absolute path on the cluster"]),
    ({"target": "aws", "data": "my data"}, ["--data 'my data' is neither a Hub ID", "absolute path"]),
    ({"target": "aws", "data": "s3://bucket/train.jsonl"},
     ["--data s3://bucket/train.jsonl: fab does not read S3 yet", "--data ./train.jsonl (uploaded once"]),
    ({"target": "local", "data": "  "}, ["--data is empty", "give a Hugging Face Hub ID or an absolute path"]),
]

# Data files as training reads them: (file name, content, expected substrings after the path).
DATA = [
    ("no-output.jsonl", '{"instruction": "a", "input": ""}\n', ["missing column 'output' (row 1)", "every row needs"]),
    ("empty.jsonl", "", ["the data set is empty", "needs rows with columns instruction, output"]),
    ("rows.csv", "question,answer\na,b\n", ["columns found: answer, question", "one of three shapes"]),
    ("rows.tsv", "instruction\toutput\na\tb\n", ["unsupported file type '.tsv'", "use one of .json, .jsonl, .parquet, .csv"]),
    ("broken.jsonl", '{"instruction": "a", "output": "b"}\n{"instruction": "c", \n',
     ["line 2 is not valid JSON", "fix or remove that line"]),
    ("int-output.jsonl", '{"instruction": "a", "output": 7}\n', ["column 'output' in row 1 must be a string, got int"]),
    ("blank-output.json", '[{"instruction": "a", "output": "  "}]', ["no row can be trained on", "left out: 1 empty answer", "fix the rows"]),
    ("scalar.json", '"just a string"', ["expected a JSON list of objects with columns instruction, output"]),
    ("list-row.jsonl", '["a", "b"]\n', ["row 1 is not an object with columns instruction, output"]),
    ("bad.parquet", "not parquet", ["cannot read as Parquet", "check the file"]),
]


def test_the_table_has_at_least_20_bad_inputs_of_each_kind_together():
    kinds = {"config": CONFIG, "program": PROGRAM, "fab": FAB_CLI, "options": OPTIONS, "data": DATA}
    assert sum(map(len, kinds.values())) >= 20 and all(kinds.values())
    assert sum("local.up" in argv for argv, _ in FAB_CLI) >= 6  # the local-cluster options


def _all_in(message: str, expected: list[str]) -> None:
    for text in expected:
        assert text in message, f"{text!r} not in: {message}"


# ------------------------------------------------------------------ stack config


@pytest.mark.parametrize("overrides,expected", CONFIG, ids=[str(o) for o, _ in CONFIG])
def test_stack_config(overrides, expected):
    raw = {k: v for k, v in {**GOOD, **overrides}.items() if v is not None}
    with pytest.raises(ConfigError) as info:
        StackConfig.from_mapping(raw)
    _all_in(str(info.value), expected)
    # and the program refuses it before declaring anything
    mocks = ClusterMocks()
    with pytest.raises(ConfigError):
        run_program(stack_config(**overrides), mocks)
    assert (mocks.components, mocks.resources) == ([], [])


@pytest.mark.parametrize("overrides,expected", PROGRAM, ids=[str(o) for o, _ in PROGRAM])
def test_stack_config_refused_by_the_program(overrides, expected):
    mocks = ClusterMocks()
    with pytest.raises(ConfigError) as info:
        run_program(stack_config(**overrides), mocks)
    _all_in(str(info.value), expected)
    assert (mocks.components, mocks.resources) == ([], [])
    assert mocks.calls  # it did ask the provider: the refusal came from the real facts


# ------------------------------------------------------------------ fab options


def _daemon_pids() -> set[str]:
    """Our daemons' pids: those in this machine's own PID namespace. The boot test's containers
    (systemd-nspawn, each with a PID namespace of its own) run slurmd, munged and sshd too, beside
    the unit tier (scripts/test.sh): theirs are not a local cluster's."""
    pids = set()
    ours = os.readlink("/proc/self/ns/pid")
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() in DAEMONS and os.readlink(comm.parent / "ns" / "pid") == ours:
                pids.add(comm.parent.name)
        except OSError:  # the process ended meanwhile
            pass
    return pids


def _host_state() -> dict:
    """What a local cluster would leave on this machine: namespaces, our links, state, daemons. The
    state files are looked for where `fab` run now would write them (SLURM_GPU_LOCAL_STATE, as
    cluster/targets/local.py reads it)."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    state = Path(os.environ.get("SLURM_GPU_LOCAL_STATE", layout.STATE))
    return {"netns": {line.split()[0] for line in netns.splitlines() if line.strip()},
            "bridge": Path(f"/sys/class/net/{layout.BRIDGE}").exists(),
            "state": (state / layout.STATE_FILE.name).exists(), "inventory": (state / layout.INVENTORY.name).exists(),
            "daemons": _daemon_pids()}


def _made(before: dict, after: dict) -> dict:
    """What appeared between two _host_state() looks (what went away is not ours to judge)."""
    made = {}
    for key, now in after.items():
        new = now - before[key] if isinstance(now, set) else now and not before[key]
        if new:
            made[key] = new
    return made


@pytest.fixture(scope="module")
def no_cluster(tmp_path_factory):
    """No local cluster's files: `fab` (a subprocess, which inherits the environment) gets an empty
    state folder of the test's own (SLURM_GPU_LOCAL_STATE), so the state and inventory a cluster left on
    this machine (a stale one after a reboot, say) play no part. Namespaces, the bridge and daemons are
    machine-wide: the local-cluster lock is held so that none comes or goes by others' hands while we
    look (scripts/test.sh never runs this tier beside the cluster tier)."""
    state = tmp_path_factory.mktemp("no-local-cluster")
    with cluster_lock(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_GPU_LOCAL_STATE", str(state))
        yield state
    assert not any(state.iterdir()), sorted(p.name for p in state.iterdir())  # nothing was written


@pytest.mark.parametrize("argv,expected", FAB_CLI, ids=[" ".join(a) for a, _ in FAB_CLI])
def test_fab_cli(no_cluster, argv, expected):
    before = _host_state()
    res = subprocess.run([FAB, *argv], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SLURM_GPU_RUNS": "/nonexistent-runs"})
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    _all_in(out, expected)
    assert "Traceback" not in out, out
    assert _made(before, _host_state()) == {}  # no namespace, link, state file or daemon appeared


@pytest.mark.parametrize("kwargs,expected", OPTIONS, ids=[str(k) for k, _ in OPTIONS])
def test_train_options(kwargs, expected):
    with pytest.raises(options.OptionError) as info:
        options.parse(**kwargs)
    _all_in(str(info.value), expected)


def test_train_options_against_the_cluster():
    inv = plan.make_inventory(2, 2)
    opts = options.parse(target="local", nodes="3")
    with pytest.raises(options.OptionError) as info:
        options.check_against(opts, inv)
    _all_in(str(info.value), ["--nodes 3", "has 2 GPU node(s); pass --nodes 2 or fewer"])


def test_local_cluster_options_direct():
    for nodes, gpus, flag in [(0, 2, "--nodes"), (-1, 2, "--nodes"), ("abc", 2, "--nodes"), (21, 2, "--nodes"),
                              (2, 0, "--gpus"), (2, 9, "--gpus")]:
        with pytest.raises(cluster.ClusterError) as info:
            cluster.up(nodes=nodes, gpus=gpus, out=lambda _m: None)  # refuses before preflight and lock
        _all_in(str(info.value), [f"{flag} must be a whole number", f"`fab local.up {flag} 2`"])


# ------------------------------------------------------------------ data files


@pytest.mark.parametrize("name,text,expected", DATA, ids=[n for n, _t, _e in DATA])
def test_data_file(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as info:
        load_local_rows(path)
    _all_in(str(info.value), [f"{path}: "] + expected)


def test_missing_data_file_names_the_setting(tmp_path):
    with pytest.raises(DataError) as info:
        load_local_rows(tmp_path / "nope.jsonl")
    _all_in(str(info.value), [f"{tmp_path}/nope.jsonl: no such data file", "set dataset_name to"])


def test_bad_data_fails_training_before_its_output_dir_is_written(tmp_path):
    """training's own entry point (what the job runs): exit 2, one line, output_dir untouched."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "a"}\n')
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    res = subprocess.run(
        [str(REPO / ".venv" / "bin" / "python"), "-m", "training.train",
         "--config", str(REPO / "training" / "configs" / "local-tiny.yaml"),
         "--dataset_name", str(data), "--model_name_or_path", str(tmp_path / "no-model"),
         "--output_dir", str(scratch / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"training data error: {data}: missing column 'output' (row 1)" in res.stderr
    assert "Traceback" not in res.stderr
    assert list(scratch.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize("value", ["٣٠", "３０", "1_0", " "])
def test_local_idle_stop_takes_ascii_digits_only(value):
    """`fab local.up --idle-stop`: str.isdigit() and int() take Unicode digits ('٣٠' is 30); the flag does not."""
    from localcluster import power_save

    with pytest.raises(power_save.PowerOptionError, match=f"--idle-stop must be 0 .* \\(got {value!r}\\)"):
        power_save.validate_idle_stop(value)
    assert power_save.validate_idle_stop("30") == 30
