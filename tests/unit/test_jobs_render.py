"""The sbatch templates rendered for AWS (L4 and H100) and the local cluster, checked by bash and shellcheck."""

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from cluster.facts import plan_hosts
from cluster.platform import BOOT_DEBIAN12, BOOT_DEBIAN13
from ops.finetune import sbatch as jobs
from tests.support import inventories

REPO = Path(__file__).resolve().parents[2]


def inventory(target="aws", gpu_type="l4", nvlink=False, gpus=4, nodes=2):
    return inventories.make(
        target, controller=("controller", "10.213.0.10"), public_ip="10.213.0.10",
        gpu_nodes=tuple((f"gpu-node-{i:02d}", f"10.213.0.{10 + i}") for i in range(1, nodes + 1)),
        gpus_per_node=gpus, gpu_type=gpu_type, nvlink=nvlink,
        python="/opt/slurm-gpu/venv/bin/python" if target == "aws" else "/work/main/.venv/bin/python",
    )


def boot_inventory(platform):
    """The boot test's inventory (boottest/boot_cluster.py): its facts carry the platform."""
    ctl, nodes = plan_hosts("10.213.1.0/24", 2)
    return inventories.make("boot", cluster_name="boot", controller=(ctl.name, ctl.ip), public_ip=ctl.ip,
                            gpu_nodes=tuple((h.name, h.ip) for h in nodes), gpus_per_node=2, gpu_type="l4",
                            subnet_cidr="10.213.1.0/24", platform=platform, ssh_user="ubuntu")


def finetune(inv, nodes=2, gpus=None):
    spec = jobs.base_spec(
        inv, jobs.FINETUNE_NAME, nodes, gpus or inv.gpus_per_node, "/scratch/slurm-gpu/jobs/20260101-abc",
        config="/scratch/slurm-gpu/jobs/20260101-abc/config.yaml",
        output_dir="/scratch/slurm-gpu/jobs/20260101-abc/output",
        train_args=jobs.train_flags({"model_name_or_path": "/scratch/my model", "n_examples": 64, "x": None}),
    )
    return jobs.render_finetune(spec)


def env_exports(script):
    return dict(re.findall(r"^export (\w+)=(.*)$", script, re.M))


def test_aws_l4_disables_p2p_and_sets_efa():
    s = finetune(inventory(gpu_type="l4", nvlink=False))
    env = env_exports(s)
    assert env["NCCL_P2P_DISABLE"] == "1"
    assert env["FI_PROVIDER"] == "efa"
    assert env["FI_EFA_USE_HUGE_PAGE"] == "0" and env["FI_EFA_FORK_SAFE"] == "1"
    assert env["LD_LIBRARY_PATH"].startswith("/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib")
    assert env["NCCL_SOCKET_IFNAME"] == "^docker,lo,veth"
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["HF_HOME"] == "/scratch/hf-cache"
    assert "#SBATCH --gres=gpu:4\n" in s
    assert "--nproc_per_node=4 " in s


def test_aws_h100_keeps_p2p_with_efa():
    s = finetune(inventory(gpu_type="h100", nvlink=True, gpus=8), gpus=8)
    env = env_exports(s)
    assert "NCCL_P2P_DISABLE" not in s
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_DEBUG"] == "INFO"
    assert "#SBATCH --gres=gpu:8\n" in s and "--nproc_per_node=8 " in s


def test_local_has_no_efa_or_nccl():
    s = finetune(inventory(target="local", gpu_type="cpu", gpus=2), gpus=2)
    env = env_exports(s)
    for var in ("FI_PROVIDER", "NCCL_DEBUG", "NCCL_P2P_DISABLE", "NCCL_SOCKET_IFNAME", "LD_LIBRARY_PATH"):
        assert var not in env
    assert "/opt/amazon" not in s
    assert env["OMP_NUM_THREADS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert "#SBATCH --gres=gpu:2\n" in s


@pytest.mark.parametrize("nodes", [1, 2])
def test_common_directives_and_launch(nodes):
    s = finetune(inventory(), nodes=nodes)
    for line in (f"--nodes={nodes}", "--ntasks-per-node=1", "--exclusive", "--requeue",
                 "--output=/scratch/logs/%x-%j.out", "--job-name=slurm-gpu-finetune", "--wait-all-nodes=1"):
        assert f"#SBATCH {line}\n" in s
    assert 'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in s
    # By address: GPU nodes resolve only the controller's name and their own.
    assert 'MASTER_ADDR=$(scontrol show node -o "$first_node" | sed -n' in s
    assert "srun -K1 -l --gres=gpu:4 bash -c" in s and '"$0" -m torch.distributed.run' in s
    assert "\n  '/opt/slurm-gpu/venv/bin/python' \\\n" in s
    # Each node's agent publishes its own address, not a host name the other nodes cannot resolve.
    assert '${addr:+--local_addr="$addr"}' in s and 'getent ahostsv4 "$(hostname)"' in s
    assert '--rdzv_backend=c10d' in s and '--rdzv_id="$SLURM_JOB_ID"' in s
    assert '--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"' in s and "MASTER_PORT=29500" in s
    assert "-m training.train" in s and "--config '/scratch/slurm-gpu/jobs/20260101-abc/config.yaml'" in s
    # flags are shell-quoted and None values dropped
    assert "--model_name_or_path '/scratch/my model'" in s and "--n_examples 64" in s and "--x " not in s
    # bounded requeue
    assert "-m training.requeue start '/scratch/slurm-gpu/jobs/20260101-abc/output' \"$restart\" 3" in s
    assert "SLURM_RESTART_COUNT" in s


def test_a_torch_without_libuv_keeps_the_rendezvous_in_a_file():
    """Debian's torch 2.6 (the boot test's Debian 13, Platform.os_torch) has no libuv TCPStore,
    which the c10d rendezvous's TCP store and the store it shares with the ranks always ask for:
    the rendezvous keeps its state in a file on the shared scratch (one per attempt), the ranks
    make their own store without libuv. Nothing else of the job differs."""
    s = finetune(boot_inventory(BOOT_DEBIAN13), gpus=2)
    assert "export USE_LIBUV=0 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in s
    assert "rdzv_file='/scratch/slurm-gpu/jobs/20260101-abc/work'/rdzv-$SLURM_JOB_ID-$restart\n" in s
    assert ('  --rdzv_backend=c10d \\\n  --rdzv_endpoint="$rdzv_file" \\\n  --rdzv_conf=store_type=file \\\n'
            '  --rdzv_id="$SLURM_JOB_ID" \\\n') in s
    assert s.index('restart=${SLURM_RESTART_COUNT:-0}') < s.index("rdzv_file=")
    plain = finetune(boot_inventory(BOOT_DEBIAN12), gpus=2)
    assert "USE_LIBUV" not in plain and "store_type" not in plain
    assert '--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"' in plain
    changed = set(s.splitlines()) ^ set(plain.splitlines())
    assert len(changed) == 11, sorted(changed)  # header, comment (4), export, file, endpoint (2), conf


def test_strict_undefined():
    with pytest.raises(jinja2.UndefinedError):
        jobs._env.get_template("finetune.sbatch.j2").render(target="aws")


def test_sanity_aws_counts_nvidia_smi_and_local_checks_standins():
    aws = jobs.render_sanity(jobs.base_spec(inventory(), jobs.SANITY_NAME, 2, 4, "/scratch/j",
                                            script_path="/scratch/j/sanity.sbatch"))
    assert "nvidia-smi -L" in aws and "gpu-standin" not in aws
    assert "exec srun -K1 -l --gres=gpu:4 bash '/scratch/j/sanity.sbatch' --task" in aws
    local = jobs.render_sanity(jobs.base_spec(inventory(target="local", gpus=2), jobs.SANITY_NAME, 2, 2,
                                              "/scratch/j", script_path="/scratch/j/sanity.sbatch"))
    assert "nvidia-smi" not in local and '"/var/lib/slurm/gpu-standin/nvidia$i"' in local
    assert "#SBATCH --gres=gpu:2\n" in local and "#SBATCH --nodes=2\n" in local


def rendered_scripts():
    out = {}
    for name, inv, gpus in (("aws-l4", inventory(), 4), ("aws-h100", inventory(gpu_type="h100", nvlink=True, gpus=8), 8),
                            ("local", inventory(target="local", gpus=2), 2),
                            ("boot-debian13", boot_inventory(BOOT_DEBIAN13), 2)):
        out[f"finetune-{name}"] = finetune(inv, gpus=gpus)
        out[f"sanity-{name}"] = jobs.render_sanity(jobs.base_spec(inv, jobs.SANITY_NAME, 2, gpus, "/scratch/j",
                                                                  script_path="/scratch/j/sanity.sbatch"))
        out[f"netcheck-{name}"] = jobs.render_netcheck(
            jobs.base_spec(inv, jobs.NETCHECK_NAME, 2, gpus, "/scratch/j", time_limit="00:03:00"),
            (4096, 1 << 20), 0.3, "eth0" if name == "local" else None)
        out[f"merge-{name}"] = jobs.render_merge(
            jobs.base_spec(inv, jobs.MERGE_NAME, 1, 1, "/scratch/j", script_path="/scratch/j/merge.sbatch",
                           output_dir="/scratch/j/merged", time_limit="02:00:00"), "/scratch/j/output")
    return out


@pytest.mark.parametrize("name", sorted(rendered_scripts()))
def test_bash_and_shellcheck(name, tmp_path):
    path = tmp_path / f"{name}.sbatch"
    path.write_text(rendered_scripts()[name])
    subprocess.run(["bash", "-n", str(path)], check=True)
    if not shutil.which("shellcheck"):
        pytest.fail("shellcheck is not installed (scripts/setup.sh installs it)")
    res = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def _head_runs(tmp_path, restart: int, spot_lines: int) -> subprocess.CompletedProcess:
    """The rendered fine-tune script's head (up to its restart limit) run by bash, as on a requeue."""
    out = tmp_path / "output"
    out.mkdir(parents=True)
    (out / "INTERRUPTED").write_text('{"step": 3}\n')  # an earlier attempt's, requeued before its script saw it
    if spot_lines:
        (out / "SPOT_REQUEUES").write_text("".join(f"17000000{i} stop at T\n" for i in range(spot_lines)))
    spec = jobs.base_spec(inventory(), jobs.FINETUNE_NAME, 2, 4, str(tmp_path), config=str(tmp_path / "c.yaml"),
                          output_dir=str(out), script_path=str(tmp_path / "finetune.sbatch"))
    text = jobs.render_finetune(dataclasses.replace(spec, python=sys.executable))
    head = text[:text.index("# The rendezvous host")] + "echo REACHED\n"
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": str(restart),
           "SLURM_JOB_NODELIST": "gpu-node-[01-02]", "PYTHONPATH": str(REPO)}
    return subprocess.run(["bash", "-c", head], env=env, capture_output=True, text=True)


def test_spot_requeues_do_not_count_toward_the_restart_limit(tmp_path):
    """Five requeues, four of them spot interruptions: one failure, under the limit of 3, so the job
    trains on; the same five requeues with no spot interruption are over it."""
    spot = _head_runs(tmp_path / "a", restart=5, spot_lines=4)
    assert spot.returncode == 0 and "REACHED" in spot.stdout, spot.stderr
    assert not (tmp_path / "a" / "output" / "INTERRUPTED").exists()  # stale: no spot requeue for a later failure
    failures = _head_runs(tmp_path / "b", restart=5, spot_lines=0)
    assert failures.returncode == 1 and "REACHED" not in failures.stdout
    assert "requeued 5 times, 5 after failures (limit 3); giving up" in failures.stderr
