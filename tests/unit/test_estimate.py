"""The estimate (ops/cost/estimate.py): its inputs, its formulas, its bill, and its errors before any host."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from ops.actions import options
from ops.cost import estimate as est

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")
SEED_CONFIG = REPO / "training" / "configs" / "qwen3-4b-lora.yaml"


def _seed(**kw) -> est.Estimate:
    cl = est.cluster_for("aws", "dev", None, **kw)
    return est.estimate(cl, est.job_from_config(SEED_CONFIG, None, None, None))


def test_seed_cluster_reads_the_stack_file_and_the_seed_job():
    e = _seed()
    cl, job = e.cluster, e.job
    assert (cl.region, cl.gpu_type, cl.controller_type, cl.nodes, cl.ranks_per_node) == \
        ("ap-northeast-2", "g6.12xlarge", "c6i.xlarge", 2, 4)
    assert job.rows == 2000 and job.model_bytes == est.MODELS["Qwen/Qwen3-4B"]["bytes"]
    steps, tokens_rank = est._steps(cl, job)
    assert steps == 16  # 2,000 rows / (2 x 8 x 8 ranks), as the baseline's run
    assert tokens_rank == pytest.approx(2000 * job.tokens_per_row / 8)
    keys = [p.key for p in e.phases]
    from ops.finetune.timeline import LABELS

    assert [k for k in keys if k in LABELS] == [k for k in LABELS if k in keys]  # the timeline's order


def test_throughput_is_measured_for_the_benchmark_gpu_and_scaled_by_flops_for_others():
    # The one results file the estimate reads names its GPU as torch reports it ("NVIDIA H100 80GB HBM3"):
    # the estimate files it under the datasheet table's name ("H100").
    newest = json.loads(est.MEASURED.read_text())
    gpus = json.loads((est.DATA / "instances.json").read_text())["gpus"]
    measured = next(k for k in gpus if k != "_about" and newest["gpu"].replace("NVIDIA ", "").split(" ")[0] == k)
    tok_s, _, basis = est.gpu_throughput(measured)
    assert basis.startswith(f"{measured}: measured")
    l4, _, basis = est.gpu_throughput("L4")
    assert l4 == pytest.approx(tok_s * gpus["L4"]["bf16_tflops"] / gpus[measured]["bf16_tflops"])
    assert f"scaled from {measured}" in basis


def test_model_load_follows_where_the_weights_are():
    e = _seed()
    model = next(p for p in e.phases if p.key == "model")
    assert model.seconds["first"] > 10 * model.seconds["again"]  # NFS from gp3 vs the nodes' page cache
    faster = next(p for p in _seed(scratch_mbps=1000).phases if p.key == "model")
    assert faster.seconds["first"] < model.seconds["first"]  # provisioned gp3 throughput reads faster ...
    bill = {c.what.split(" at ")[0]: c.usd for c in est.cost(_seed(scratch_mbps=1000), "first")}
    assert any(k.startswith("gp3 throughput +875 MB/s") for k in bill)  # ... and is billed


def test_shared_volume_throughput_comes_from_the_stacks_inventory():
    """`pulumi up` (under mocks) with slurm-gpu:scratchThroughputMBps 1000: the inventory it exports
    carries the volume's throughput and IOPS, and the estimate reads the weights at that rate and
    bills both; --scratch-mbps stays a what-if on top."""
    from cluster.inventory import Inventory
    from tests.support.pulumi_mocks import run_program, stack_config

    inv = Inventory.from_dict(run_program(stack_config(scratchThroughputMBps="1000")).outputs["inventory"])
    job = est.job_from_config(SEED_CONFIG, None, None, None)
    fast = est.estimate(est.cluster_for("aws", "dev", inv), job)
    assert (fast.cluster.scratch_mbps, fast.cluster.scratch_iops) == (1000, 4000)
    base = _seed()
    assert (base.cluster.scratch_mbps, base.cluster.scratch_iops) == (125, 3000)  # the stack file's default
    model = {name: next(p for p in e.phases if p.key == "model") for name, e in (("fast", fast), ("base", base))}
    assert "the stack's inventory" in model["fast"].basis
    # Two nodes x 8.05 GB: gp3-bound at 125 MB/s (two reads), network-bound at 1000 MB/s.
    assert model["base"].seconds["first"] == pytest.approx(2 * 8.05e9 / 125e6 + 1.6)
    assert model["fast"].seconds["first"] == pytest.approx(max(2 * 8.05e9 / 1000e6, 2 * 8.05e9 / (12.5e9 / 8)) + 1.6)
    p = est.prices("ap-northeast-2")
    bill = {c.what.split(" at ")[0]: c.usd for c in est.cost(fast, "first")}
    wall = fast.total("first")
    assert bill["gp3 throughput +875 MB/s"] == pytest.approx(875 * p["gp3_per_mbps_month"] * wall / (730 * 3600))
    assert bill["gp3 IOPS +1000"] == pytest.approx(1000 * p["gp3_per_iops_month"] * wall / (730 * 3600))
    assert not any(k.startswith("gp3 ") for k in (c.what for c in est.cost(base, "first")))
    what_if = est.cluster_for("aws", "dev", inv, scratch_mbps=500)
    assert (what_if.scratch_mbps, what_if.scratch_iops, what_if.scratch_from) == (500, 4000, "--scratch-mbps")


def _stack_file(tmp_path, **settings):
    """A Pulumi.x.yaml with these `slurm-gpu:` settings (and a region), read as the estimate reads it."""
    lines = "".join(f"  slurm-gpu:{key}: {value}\n" for key, value in settings.items())
    (tmp_path / "Pulumi.x.yaml").write_text(f"config:\n  aws:region: ap-northeast-2\n{lines}")
    return est.stack_settings("x", tmp_path)


def test_shared_volume_from_the_stack_file_by_the_one_parse_of_the_settings(tmp_path):
    """The estimate reads the stack file through cluster/stack_config.py, as `pulumi up` does: gp3's
    IOPS rule (cluster/gp3.py) gives the IOPS a throughput needs, and a setting `pulumi up` refuses is
    refused here with the same message."""
    settings = _stack_file(tmp_path, scratchThroughputMBps=800).settings
    assert est._scratch_volume(settings, None, None) == (800, 3200, "slurm-gpu:scratchThroughputMBps")
    settings = _stack_file(tmp_path, scratchThroughputMBps=800, scratchIops=9000, scratchSizeGiB=300).settings
    assert est._scratch_volume(settings, None, None)[1] == 9000 and est._scratch_gib(settings, None) == 300
    with pytest.raises(est.EstimateError, match=r"^Pulumi.x.yaml: slurm-gpu:scratchThroughputMBps is 2000; gp3 "
                                                r"provisions 125 to 1000 MiB/s.*pulumi config set"):
        _stack_file(tmp_path, scratchThroughputMBps=2000)
    with pytest.raises(est.EstimateError, match=r"^Pulumi.x.yaml: slurm-gpu:scratchSizeGiB must be a whole number"):
        _stack_file(tmp_path, scratchSizeGiB="1TB")


def test_the_way_in_is_not_needed_to_estimate(tmp_path):
    """adminCidr and sshPublicKey say who reaches the hosts, not what they cost: a stack file without
    them (Pulumi.dev.yaml) or with an encrypted one is read."""
    assert _stack_file(tmp_path).settings.admin_cidr is None
    assert _stack_file(tmp_path, sshPublicKey="{secure: AAABAxyz}").settings.gpu_node_count == 2


def test_reserved_capacity_has_no_idle_tail_as_its_stack_has_none(tmp_path, monkeypatch):
    """On a reserved market idleStopMinutes defaults to 0 (cluster/stack_config.py: stopping saves
    nothing there, so the nodes stay up), so the estimate bills no idle tail for it."""
    stack_file = _stack_file(tmp_path, gpuMarket="capacity-reservation", capacityReservationId="cr-0123456789abcdef0",
                             availabilityZone="ap-northeast-2a")
    monkeypatch.setattr(est, "stack_settings", lambda stack, repo=est.REPO: stack_file)
    e = est.estimate(est.cluster_for("aws", "x", None), est.job_from_config(SEED_CONFIG, None, None, None))
    assert (e.cluster.idle_stop_min, e.cluster.reservation_id) == (0, "cr-0123456789abcdef0")
    assert est.idle_tail(e) is None


def test_scratch_volume_size_from_the_inventory_else_the_stack_file(tmp_path):
    from cluster.spec import AwsResources, ScratchVolume
    from tests.support import inventories

    inv = inventories.make(aws=AwsResources(scratch_volume=ScratchVolume(125, 3000, 750, "vol-0123")))
    assert est._scratch_gib(_stack_file(tmp_path).settings, inv) == 750
    assert est._scratch_gib(_stack_file(tmp_path, scratchSizeGiB=300).settings, None) == 300


def test_new_stack_boot_installs_the_training_stack_from_the_controllers_cache(monkeypatch):
    """No NAT bytes: the controller's download (25 s at 150 MB/s) ends inside its 120 s head start;
    the two nodes read 3.8 GB each over the controller's network (12.5 Gbit/s; c6i.xlarge's 8 GiB
    page cache still holds the wheels it just wrote) and install in 60 s."""
    e = _seed()
    stack = next(p for p in e.phases if p.key == "boot_stack")
    assert stack.seconds["new"] == pytest.approx(2 * 3.8e9 / (12.5e9 / 8) + 60)
    assert stack.seconds["first"] == stack.seconds["again"] == 0
    assert "no NAT" in stack.basis and "0 s left to wait" in stack.basis
    # A hub slow enough that the download outlasts the head start: the nodes wait for the rest.
    monkeypatch.setattr(est, "HUB_MBPS", 20.0)
    waited = next(p for p in _seed().phases if p.key == "boot_stack")
    assert waited.seconds["new"] == pytest.approx(3.8e9 / 20e6 - 120 + 2 * 3.8e9 / (12.5e9 / 8) + 60)


def test_cost_is_instances_by_the_second_plus_nat_and_ebs():
    e = _seed()
    p = est.prices("ap-northeast-2")
    for scenario in est.SCENARIOS:
        wall = e.total(scenario)
        bill = est.cost(e, scenario)
        assert bill[0].usd == pytest.approx(2 * p["instance_per_h"]["g6.12xlarge"] * wall / 3600)
        nat = p["nat_per_h"] * wall / 3600 + e.nat_bytes[scenario] / 1e9 * p["nat_per_gb"]
        assert bill[2].usd == pytest.approx(nat)
        assert bill[3].usd == pytest.approx(600 * p["gp3_per_gb_month"] * wall / (730 * 3600))
        # The shared /scratch's own volume (slurm-gpu:scratchSizeGiB's default 100 GB), priced apart.
        assert bill[4].what.startswith("EBS gp3 /scratch volume 100 GB")
        assert bill[4].usd == pytest.approx(100 * p["gp3_per_gb_month"] * wall / (730 * 3600))
    # The controller fetches model, data and the nodes' wheels outside the NAT gateway; a new
    # stack's nodes fetch their apt packages through it.
    assert e.nat_bytes["again"] == e.nat_bytes["first"] == 0
    assert e.nat_bytes["new"] == 2 * est.APT_BYTES_PER_NODE
    assert est.idle_tail(e).usd == pytest.approx(2 * p["instance_per_h"]["g6.12xlarge"] * 0.5)


def test_readme_figures_are_the_estimates():
    e = _seed()
    text = (REPO / "README.md").read_text()
    for scenario in ("new", "again"):
        minutes = f"{e.total(scenario) / 60:.1f} min"
        dollars = f"${sum(c.usd for c in est.cost(e, scenario)):.2f}"
        assert minutes in text and dollars in text, (scenario, minutes, dollars)


@pytest.mark.parametrize("kwargs, words", [
    ({"gpu_instance_type": "g9.huge", "region": "us-east-1"}, "ops/data/instances.json"),
    ({"gpu_instance_type": "g6.12xlarge", "region": "mars-1"}, "ops/data/prices.json"),
    ({"gpu_instance_type": "p5.48xlarge", "region": "ap-northeast-2"}, "no on-demand price"),
    ({"scratch_mbps": "0"}, "--scratch-mbps must be positive"),
    ({"scratch_mbps": "2000"}, "at most 1000 MB/s"),
    ({"scratch_mbps": "fast"}, "--scratch-mbps must be a number"),
])
def test_bad_inputs_name_the_setting(kwargs, words):
    with pytest.raises(est.EstimateError, match=words.replace("+", r"\+").replace(".", r"\.")):
        est.cluster_for("aws", "dev", None, **kwargs)


def test_unknown_model_needs_its_size_and_stack_needs_its_file():
    with pytest.raises(est.EstimateError, match="--model-gb"):
        est.job_from_config(SEED_CONFIG, "someone/unknown-model", None, None)
    assert est.job_from_config(SEED_CONFIG, "someone/unknown-model", None, None, model_gb=3).model_bytes == 3e9
    with pytest.raises(est.EstimateError, match="no Pulumi.nope.yaml"):
        est.stack_settings("nope")


def test_fab_estimate_bad_flag_is_a_clean_error_and_good_flags_print_the_table(tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}  # no inventory reachable: stack file only
    bad = subprocess.run([FAB, "estimate", "--tokens-per-row", "-5"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1 and "fab estimate: --tokens-per-row must be positive" in bad.stderr
    assert "Traceback" not in bad.stderr
    ok = subprocess.run([FAB, "train", "--estimate", "--gpu-instance-type", "x"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode != 0  # train has no --gpu-instance-type: invoke says so
    ok = subprocess.run([FAB, "train", "--estimate"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "estimate: aws cluster, 2 x g6.12xlarge" in ok.stdout and "cost, new stack" in ok.stdout


def test_options_and_estimate_agree_on_the_local_job():
    opts = options.parse(target="local")
    e = est.for_run(opts, None)
    assert e.cluster.calibrated and e.job.rows == 400
    assert e.total("again") > 0 and est.cost(e, "again") == []
