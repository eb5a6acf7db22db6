"""A corrupt local-cluster state file does not stop `fab local.up` / `local.down` on a real cluster
(the state file's own checks: tests/unit/test_local_state.py).
"""

from __future__ import annotations

import pytest

from localcluster import health, netns, state
from localcluster import lifecycle as cluster
from localcluster import topology as layout


@pytest.mark.cluster
def test_up_and_down_get_past_a_corrupt_state_file():
    """Root: a cluster whose state file is garbled is made again by `up` and removed by `down`
    (both find its namespaces by name)."""
    from tests.support.local_cluster import fresh_cluster

    with fresh_cluster(nodes=1, gpus=1):
        layout.STATE_FILE.write_text('{"nodes": 1, "gp')
        lines: list[str] = []
        cluster.up(nodes=1, gpus=1, out=lines.append)
        assert "taking down what is left of that cluster" in lines[0], lines
        assert health.problems(state.load()) == []
        layout.STATE_FILE.write_text("[]")
        cluster.down(out=lines.append)
        assert "removing what is found of that cluster by name" in lines[-2], lines
        assert netns.our_netns() == [] and not netns.link_exists(layout.BRIDGE)
        assert not layout.STATE_FILE.exists() and not layout.INVENTORY.exists()
