"""`fab status` and `fab update-nodes` on the real local cluster: a node that ran an older bootstrap
is named behind; the update brings an idle one up to date (only the changed step runs) and skips a
node with a running job, which keeps running.

"An older checkout" is played by an older script and version record on both nodes: the script's
healthcheck step differs from what this checkout renders, as after a `git pull` that changed it.
"""

from __future__ import annotations

import time

import pytest

from bootstrap import user_data
from cluster import hostpaths
from localcluster import topology as layout
from ops.actions import node_update, slurm, status_view
from ops.ssh import remote
from tests.support.local_cluster import fresh_cluster

pytestmark = pytest.mark.cluster
OLD = "0123456789abcdef"


def _age(name: str) -> None:
    """Put an older bootstrap on a node: its healthcheck step differs, its record is OLD."""
    script = layout.host_dir(name) / "sbin" / "slurm-gpu-bootstrap"
    script.write_text(script.read_text().replace('bash -n "$hc"', 'bash -n "$hc" || true'))
    (layout.host_dir(name) / "lib-slurm" / "slurm-gpu" / "bootstrap.version").write_text(OLD + "\n")


def _running_job(ctl, node: str) -> str:
    job = ctl.run(f"sbatch -w {node} -t 10 -o /dev/null --wrap 'sleep 600'", hide=True).stdout.split()[-1]
    deadline = time.monotonic() + 30
    while ctl.run(f"squeue -h -j {job} -o %T", hide=True).stdout.strip() != "RUNNING":
        assert time.monotonic() < deadline, f"job {job} did not start"
        time.sleep(0.3)
    return job


def _behind(said: list[str]) -> list[str]:
    return sorted(line.split()[1] for line in said if line.startswith("note:") and "behind" in line)


def test_status_names_nodes_behind_and_update_takes_idle_ones_only():
    with fresh_cluster(nodes=2, gpus=1) as (inventory, _):
        cl = remote.connect(inventory)
        ctl = cl.controller
        facts = inventory.facts
        try:
            said: list[str] = []
            status_view.show(cl, say=said.append)
            assert _behind(said) == []  # `local.up` ran this checkout's bootstrap on both
            for name in ("gpu-node-01", "gpu-node-02"):
                _age(name)
            said.clear()
            status_view.show(cl, say=said.append)
            assert _behind(said) == ["gpu-node-01", "gpu-node-02"]
            assert any(f"gpu-node-01 ran bootstrap {OLD}" in line for line in said)

            job = _running_job(ctl, "gpu-node-02")
            said.clear()
            result = node_update.update(cl, say=said.append)
            assert result.updated == {"gpu-node-01": ["healthcheck"]}, said
            assert f"job {job}" in result.skipped["gpu-node-02"], said
            # The busy node: untouched, its job still running, never drained.
            assert ctl.run(f"squeue -h -j {job} -o %T", hide=True).stdout.strip() == "RUNNING"
            assert "drain" not in slurm.node_states(ctl)["gpu-node-02"].state
            assert (layout.host_dir("gpu-node-02") / "lib-slurm" / "slurm-gpu" / "bootstrap.version") \
                .read_text().strip() == OLD
            # The idle node: this checkout's script, its version recorded, back in service.
            host = layout.host_dir("gpu-node-01")
            assert (host / "sbin" / "slurm-gpu-bootstrap").read_text() == \
                user_data.bootstrap_files(facts, "gpu", "gpu-node-01")[hostpaths.BOOTSTRAP_PATH]
            assert (host / "lib-slurm" / "slurm-gpu" / "bootstrap.version").read_text().strip() == \
                node_update.current_version(facts, "gpu-node-01")
            statuses = {p.stem: p.read_text().split()[0]
                        for p in (host / "lib-slurm" / "slurm-gpu" / "bootstrap").glob("*.status")}
            assert statuses.pop("healthcheck") == "ok" and set(statuses.values()) == {"skipped"}
            # Back in service (slurmd, restarted by the bootstrap, answers again within seconds).
            slurm.wait_idle(ctl, ["gpu-node-01"], timeout_s=30, resume_down=False)

            said.clear()
            status_view.show(cl, say=said.append)
            assert _behind(said) == ["gpu-node-02"]
            line = node_update.behind_warning(cl)  # `fab train`'s warning
            assert line and "gpu-node-02" in line and "gpu-node-01" not in line

            # An update interrupted after its drain: the node, drained with update-nodes' own reason
            # (as sinfo reports it), is updated and resumed, not skipped. Slurm 22.05 here cannot
            # exclude it from power saving (`scontrol update SuspendExcNodes` came in 23.02): said.
            ctl.run(f"scancel {job}", hide=True)
            _age("gpu-node-01")
            ctl.run(f"scontrol update nodename=gpu-node-01 state=drain reason='{node_update.REASON}'", hide=True)
            slurm.wait_idle(ctl, ["gpu-node-02"], timeout_s=60, resume_down=False)
            said.clear()
            result = node_update.update(cl, say=said.append)
            assert sorted(result.updated) == ["gpu-node-01", "gpu-node-02"], said
            assert result.drained == {} and result.skipped == {}, said
            slurm.wait_idle(ctl, ["gpu-node-01", "gpu-node-02"], timeout_s=30, resume_down=False)
            version = ctl.run("scontrol --version", hide=True).stdout
            if version.startswith("slurm 22."):
                assert any("cannot keep power saving off gpu-node-01" in line for line in said), said
            assert node_update.behind_warning(cl) is None
        finally:
            cl.close()
