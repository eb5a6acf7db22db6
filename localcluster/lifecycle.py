"""The local cluster: `up`, `down` and `status` (the bodies of `fab local.*`).

A controller and N GPU hosts, each a set of namespaces on bridge sgpu0, running
real munged, sshd, slurmctld and slurmd with the files bootstrap/ renders for
AWS and the same bootstrap scripts (minus the steps a namespace host cannot do).

`up` on a healthy cluster of the same size does nothing; with another size it
refuses and says to run `fab local.down` first (a running cluster may hold jobs).
A cluster found broken (a host or daemon gone) is taken down and made again.
Any failure during `up` takes down what was made before the error is raised.

The parts: preflight.py (option values, root, packages, one operation at a time),
plan.py (hosts, facts, inventory), state.py (what was made), files.py, build.py,
health.py, teardown.py.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.inventory import Inventory
from cluster.targets.local import LOCAL
from localcluster import health, state
from localcluster import power_save as power
from localcluster import topology as layout
from localcluster.build import build
from localcluster.dismantle import leftovers, teardown
from localcluster.preflight import ClusterError, op_lock, preflight, validate
from localcluster.state import ClusterState, StateFileError

__all__ = ["ClusterError", "down", "status", "up"]

Out = Callable[[str], None]


def _silent(_msg: str) -> None:
    pass


def _saved(out: Out, then: str = "") -> ClusterState | None:
    """The saved state; an unreadable file is said (with what happens `then`) and treated
    as none: teardown finds the cluster's namespaces by name."""
    try:
        return state.load()
    except StateFileError as exc:
        out(f"{exc}; {then}")
        return None


def up(nodes=layout.DEFAULT_NODES, gpus=layout.DEFAULT_GPUS, fresh_keys: bool = False,
       out: Out = print, idle_stop_s=0, cred_expire: int | None = None) -> Inventory:
    """Bring the cluster up (see the module docstring); returns its inventory.
    idle_stop_s > 0: Slurm stops a GPU host's slurmd after that many idle seconds.
    cred_expire: AuthInfo=cred_expire, the wait before a requeued job starts again (None: plan.CRED_EXPIRE_S,
    which a cluster that loses a node needs)."""
    nodes, gpus = validate(nodes, gpus)
    idle_stop_s = power.validate_idle_stop(idle_stop_s)
    preflight()
    with op_lock():
        saved = _saved(out, "taking down what is left of that cluster")
        if saved is not None:
            wanted = (nodes, gpus, idle_stop_s, cred_expire)
            if (saved.nodes, saved.gpus, saved.idle_stop_s, saved.cred_expire) != wanted:
                raise ClusterError(
                    f"a local cluster with {saved.nodes} GPU hosts x {saved.gpus} GPUs "
                    f"(idle stop {saved.idle_stop_s} s, cred_expire {saved.cred_expire or 'default'}) is already "
                    f"up; run `fab local.down` first to make one with {nodes} x {gpus} (idle stop {idle_stop_s} s, "
                    f"cred_expire {cred_expire or 'default'})")
            problems = health.problems(saved)
            if not problems:
                out(f"local cluster already up ({nodes} GPU hosts x {gpus} GPUs); nothing to do")
                return LOCAL.load(None)
            out(f"local cluster is broken ({'; '.join(problems)}); recreating it")
        if saved is not None or layout.STATE_FILE.exists() or leftovers():
            teardown(saved, out=_silent)
        try:
            return build(nodes, gpus, fresh_keys, out, idle_stop_s, cred_expire)
        except BaseException:
            out("local.up failed; taking down what was made")
            teardown(_saved(_silent), out=_silent)
            raise


def down(out: Out = print) -> None:
    """Stop every process of the cluster and remove its namespaces, bridge and runtime files."""
    preflight()
    with op_lock():
        teardown(_saved(out, "removing what is found of that cluster by name"), out)


def status(out: Out = print) -> bool:
    """Print the hosts and the controller's node table; True when all is up."""
    try:
        saved = state.load()
    except StateFileError as exc:
        out(f"{exc}; `fab local.down` removes what is left of that cluster")
        return False
    if saved is None:
        out("no local cluster (start one with `fab local.up`)")
        return False
    return health.report(saved, out)
