"""`fab local.up`, `fab local.status`, `fab local.down`: the local cluster."""

from __future__ import annotations

import subprocess

from invoke import Collection, Exit, task

from localcluster import lifecycle as cluster
from localcluster import topology as layout


def _fail(exc: Exception) -> Exit:
    return Exit(f"error: {exc}", code=1)


@task(help={
    "nodes": f"GPU hosts to make ({layout.MIN_NODES}-{layout.MAX_NODES}, default {layout.DEFAULT_NODES})",
    "gpus": f"stand-in GPUs per host ({layout.MIN_GPUS}-{layout.MAX_GPUS}, default {layout.DEFAULT_GPUS})",
    "fresh-keys": "leave each GPU host with its own munge key, as a fresh AWS node "
                  "(`fab train` then installs the controller's key)",
    "idle-stop": "seconds a GPU host may stay idle before Slurm stops its slurmd "
                 "(power saving, as idleStopMinutes on AWS; default 0: never)",
})
def up(c, nodes=None, gpus=None, fresh_keys=False, idle_stop=None):
    """Start the local cluster: a controller and N GPU hosts in network namespaces (root).

    Real munged, sshd, slurmctld and slurmd run from the files bootstrap/ renders
    for AWS; the inventory is written to /var/lib/slurm-gpu-local/inventory.json.
    Idempotent: a healthy cluster of the same size is left alone; for another size
    run `fab local.down` first.
    """
    # Defaults of None make invoke pass the raw text, so `preflight.validate` can
    # report a bad value by option name instead of invoke's traceback.
    try:
        cluster.up(nodes=layout.DEFAULT_NODES if nodes is None else nodes,
                   gpus=layout.DEFAULT_GPUS if gpus is None else gpus, fresh_keys=fresh_keys,
                   idle_stop_s=0 if idle_stop is None else idle_stop)
    except (cluster.ClusterError, RuntimeError, ValueError) as exc:
        raise _fail(exc) from None


@task
def status(c):
    """Show the local cluster's hosts (name, IP, up/down, daemons) and its `sinfo` node table."""
    try:
        ok = cluster.status()
    except (cluster.ClusterError, RuntimeError, OSError, subprocess.SubprocessError) as exc:
        # e.g. a host vanishing while it is looked at: the cluster is broken, not the tool
        raise _fail(f"{exc}; the local cluster is not healthy: `fab local.down && fab local.up`") from None
    if not ok:
        raise Exit(code=1)


@task
def down(c):
    """Stop the local cluster: no namespace, process, mount or bridge is left (keeps /scratch data)."""
    try:
        cluster.down()
    except (cluster.ClusterError, RuntimeError) as exc:
        raise _fail(exc) from None


ns = Collection(up, status, down)
