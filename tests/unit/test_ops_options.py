"""`fab train` flags: every bad value is refused with the flag's name and a fix, before any host is touched."""

import subprocess

import pytest

from ops.actions import options
from tests.support import inventories
from tests.unit.test_ops_units import REPO

INV = inventories.make(
    "local", cluster_name="local", controller=("controller", "10.213.0.10"), public_ip="10.213.0.10",
    gpu_nodes=(("gpu-node-01", "10.213.0.11"), ("gpu-node-02", "10.213.0.12")),
    gpus_per_node=2, gpu_type="sim", python="/usr/bin/python3", service_cmd="hostctl {action} {service}",
)


@pytest.fixture
def bad_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("learning_rate: [1, 2\n")
    return str(p)


@pytest.fixture
def list_yaml(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    return str(p)


BAD = [
    ({"target": "gcp"}, "--target"),
    ({"target": "local", "stack": "dev"}, "--stack"),
    ({"target": "local", "nodes": "two"}, "--nodes"),
    ({"target": "local", "nodes": "0"}, "--nodes"),
    ({"target": "local", "gpus_per_node": "-1"}, "--gpus-per-node"),
    ({"target": "local", "examples": "1.5"}, "--examples"),
    ({"target": "local", "config": "/nonexistent/x.yaml"}, "--config"),
    ({"target": "local", "model": "Qwen/Qwen3-4B"}, "--model"),
    ({"target": "local", "data": "tatsu-lab/alpaca"}, "--data"),
    ({"target": "aws", "model": "not a model id"}, "--model"),
    ({"target": "aws", "data": "../data.jsonl"}, "--data"),
    ({"target": "aws", "model": "  "}, "--model"),
    ({"target": "local", "identity": "/nonexistent/id_ed25519"}, "--identity"),
    ({"target": "local", "nodes": "٢"}, "--nodes"),  # Arabic-Indic 2: int() takes it, a flag does not
    ({"target": "local", "gpus_per_node": "２"}, "--gpus-per-node"),  # fullwidth 2
    ({"target": "local", "examples": "1_000"}, "--examples"),
    ({"target": "local", "max_cost": "NaN"}, "--max-cost"),
]


@pytest.mark.parametrize("kwargs,flag", BAD, ids=[f for _, f in BAD])
def test_bad_flag_names_itself(kwargs, flag):
    with pytest.raises(options.OptionError) as err:
        options.parse(**kwargs)
    assert flag in str(err.value)


def test_bad_config_files(bad_yaml, list_yaml):
    for path in (bad_yaml, list_yaml):
        with pytest.raises(options.OptionError, match="--config"):
            options.parse(target="local", config=path)


@pytest.mark.parametrize("text", ["nan", "inf", "-Infinity", "1e999", "٣", "３.5", "1_0", "0x10", "", " "])
def test_the_number_parser_takes_ascii_finite_numbers_only(text):
    for kind in (int, float):
        with pytest.raises(options.OptionError, match=f"--x must be a (whole )?number, not {text!r}"):
            options.number("x", text, kind)


@pytest.mark.parametrize("kind", [int, float])
def test_a_huge_number_is_the_flags_error_not_a_traceback(kind):
    # int() refuses over 4300 digits with a bare ValueError (sys.set_int_max_str_digits)
    with pytest.raises(options.OptionError, match="--x must be a (whole )?number, not a value of 5000 characters"):
        options.number("x", "9" * 5000, kind)


@pytest.mark.parametrize("job", ["9" * 5000, "12345678901", "0", "1;id", "../x", "12_3"])
def test_a_job_flag_is_a_slurm_job_id_before_anything_is_used(job):
    with pytest.raises(options.OptionError, match="--job must be a Slurm job id"):
        options.parse_job(job)
    assert options.parse_job("4294967294") == "4294967294"


def test_the_number_parser_reads_plain_numbers():
    assert [options.number("x", t, float) for t in ("2", "+2.5", ".5", "1e3", " 7 ")] == [2.0, 2.5, 0.5, 1000.0, 7.0]
    assert [options.number("x", t, int) for t in ("2", "+3", "-1", "007")] == [2, 3, -1, 7]


@pytest.mark.parametrize("setting", ["model_name_or_path: 12", "dataset_name: 3.5", "output_dir: 7"])
def test_a_config_location_must_be_a_string_not_a_number(tmp_path, setting):
    """YAML reads `model_name_or_path: 12` as the number 12: not a Hub ID, a mistake to name."""
    p = tmp_path / "train.yaml"
    p.write_text((REPO / "training" / "configs" / "qwen3-4b-lora.yaml").read_text() + setting + "\n")
    key = setting.split(":")[0]
    with pytest.raises(options.OptionError, match=f"{key}: .* is the wrong type; set {key} to a string"):
        options.parse(target="aws", config=str(p))


@pytest.mark.parametrize("setting", ["eval_split: 0", "eval_split: 32", "eval_split: 0.05", "eval_split: auto"])
def test_a_text_setting_documented_with_numbers_takes_them(tmp_path, setting):
    """eval_split is text (auto) or a number (a count, a fraction, 0 = off): YAML's numbers are meant."""
    p = tmp_path / "train.yaml"
    p.write_text((REPO / "training" / "configs" / "qwen3-4b-lora.yaml").read_text() + setting + "\n")
    options.parse(target="aws", config=str(p))


def test_counts_checked_against_inventory():
    with pytest.raises(options.OptionError, match=r"--nodes 3: .* has 2 GPU node\(s\); pass --nodes 2"):
        options.check_against(options.parse(target="local", nodes="3"), INV)
    with pytest.raises(options.OptionError, match="--gpus-per-node 4"):
        options.check_against(options.parse(target="local", gpus_per_node="4"), INV)
    assert options.check_against(options.parse(target="local"), INV) == (2, 2)
    assert options.check_against(options.parse(target="local", nodes="1", gpus_per_node="1"), INV) == (1, 1)


def test_good_flags_and_defaults():
    o = options.parse(target="aws", model="Qwen/Qwen3-4B", data="/scratch/d.jsonl", examples="64")
    assert o.config.name == "qwen3-4b-lora.yaml" and o.examples == 64
    assert o.model == "Qwen/Qwen3-4B" and o.data == "/scratch/d.jsonl"
    assert options.parse(target="local").config.name == "local-tiny.yaml"
    assert options.parse().target == "aws"  # the current Pulumi stack by default


def test_cli_refuses_before_touching_hosts():
    # The flag error comes before the inventory is even read, with no traceback.
    res = subprocess.run([str(REPO / ".venv/bin/fab"), "train", "--target", "local", "--nodes", "x"],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 1
    assert "--nodes must be a whole number" in res.stderr + res.stdout
    assert "Traceback" not in res.stderr


def test_tasks_other_than_train_check_their_flags_without_the_training_stack():
    """status, logs, cancel, reconfigure and ssh read no training config: checking their flags must not
    import TRL/transformers (seconds per command), while `fab train`'s check still does."""
    probe = ("import sys; from ops.actions import options; "
             "o = options.parse_cluster(target='local', stack=None, identity=None); "
             "print(o.target, 'trl' in sys.modules, 'transformers' in sys.modules)")
    res = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", probe], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["local", "False", "False"], res.stdout + res.stderr
    with pytest.raises(options.OptionError, match="--stack names a Pulumi stack"):
        options.parse_cluster(target="local", stack="dev")
    with pytest.raises(options.OptionError, match="--identity /nonexistent/key: no readable key file"):
        options.parse_cluster(target="aws", identity="/nonexistent/key")
    assert options.parse(target="local").target == "local"  # train's parse: the same checks, and the config
