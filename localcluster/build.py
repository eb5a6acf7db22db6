"""Making a local cluster from nothing: the files, the namespace hosts, the same bootstrap
scripts as AWS, the daemons, and (unless fresh_keys) the controller's munge key on every
host, as `fab train` installs it on AWS. The state is saved after each step that makes
something, so `teardown` can remove a half-made cluster.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from cluster import hostpaths
from cluster.inventory import Inventory
from cluster.targets.local import LOCAL_SKIP_STEPS
from localcluster import daemons, files, hosts, netns, plan, state
from localcluster import topology as layout
from localcluster.state import ClusterState, HostEntry, HostSpec


def build(nodes: int, gpus: int, fresh_keys: bool, out: Callable[[str], None],
          idle_stop_s: int = 0, cred_expire: int | None = None) -> Inventory:
    """Make the cluster (options already checked, no cluster present); returns its inventory."""
    t0 = time.monotonic()
    specs = plan.host_specs(nodes)
    facts = plan.cluster_facts(nodes, gpus, idle_stop_s, cred_expire)
    saved = ClusterState(nodes=nodes, gpus=gpus, fresh_keys=fresh_keys, idle_stop_s=idle_stop_s,
                         cred_expire=cred_expire, started=time.time())
    layout.STATE.mkdir(parents=True, exist_ok=True)
    state.save(saved)  # from here on, `down` knows what to remove
    made = []
    for mp in layout.MOUNT_POINTS:
        if not mp.exists():
            mp.mkdir(mode=0o755)
            made.append(str(mp))
    saved = dataclasses.replace(saved, made_mount_points=tuple(made))
    state.save(saved)
    files.write_files(facts, specs)

    netns.ensure_bridge()
    for s in specs:
        netns.add_host(s.netns, s.index, s.ip)
        saved = dataclasses.replace(saved, hosts=(*saved.hosts, HostEntry.of(s)))
        state.save(saved)
    logs = {s.name: layout.host_dir(s.name) / "holder.log" for s in specs}
    procs = {s.name: hosts.start_holder(s.name, netns.netns_path(s.netns), files.host_mounts(s), logs[s.name])
             for s in specs}
    ready = []
    for entry in saved.hosts:
        pid = hosts.wait_ready(procs[entry.name], entry.name, logs[entry.name])
        ready.append(dataclasses.replace(entry, pid=pid, ns=tuple(sorted(hosts.ns_ids(pid).values()))))
    saved = dataclasses.replace(saved, hosts=tuple(ready))
    state.save(saved)
    pids = {e.name: e.pid for e in saved.hosts}
    ctl, gpu_specs = specs[0], specs[1:]

    # The same bootstrap scripts as AWS; the controller first (it makes /scratch/logs,
    # which the GPU hosts' scratch step waits for).
    def bootstrap(s: HostSpec) -> None:
        hosts.run(pids[s.name], ["env", f"SLURM_GPU_SKIP_STEPS={' '.join(LOCAL_SKIP_STEPS[s.role])}",
                                 "bash", hostpaths.BOOTSTRAP_PATH], host=s.name, timeout=120)

    bootstrap(ctl)
    daemons.each(bootstrap, gpu_specs)
    out(f"  {nodes + 1} hosts made and bootstrapped ({time.monotonic() - t0:.1f} s)")

    def base_daemons(s: HostSpec) -> None:
        daemons.hostctl(pids[s.name], s.name, "start", "munge")
        daemons.hostctl(pids[s.name], s.name, "start", "sshd")
        if s.role == "controller":
            daemons.hostctl(pids[s.name], s.name, "start", "slurmctld")

    daemons.each(base_daemons, specs)
    for s in specs:
        daemons.poll(f"munged on {s.name}", lambda p=pids[s.name]: daemons.munge_works(p), 20)
        daemons.poll(f"sshd on {s.name} ({s.ip}:22)", lambda ip=s.ip: daemons.port_open(ip, 22), 20)
    daemons.poll("slurmctld on controller", lambda: daemons.slurmctld_up(pids[ctl.name]), 30, 0.2)
    out(f"  munged, sshd, slurmctld running ({time.monotonic() - t0:.1f} s)")

    inventory = plan.make_inventory(nodes, gpus, idle_stop_s, cred_expire)
    files.write_file(layout.INVENTORY, inventory.to_json() + "\n", 0o600)
    if not fresh_keys:
        # Exactly what `fab train` does on AWS: the controller's key to every node.
        from ops.actions.munge import distribute_key
        from ops.ssh import remote

        conns = remote.connect(inventory)
        try:
            sync = distribute_key(conns.controller, conns.nodes, inventory.service_cmd)
        finally:
            conns.close()
        out(f"  munge key installed on {', '.join(sync.installed) or 'no host'} "
            f"({time.monotonic() - t0:.1f} s)")

    if fresh_keys:
        # Configless slurmd fetches its config from slurmctld over munge: with a host's own key
        # it cannot start, as on a fresh AWS node. `fab train` installs the key and starts it.
        out("  GPU hosts keep their own munge keys: slurmd starts once `fab train` installs the key")
    else:
        daemons.each(lambda s: daemons.hostctl(pids[s.name], s.name, "start", "slurmd"), gpu_specs)
        daemons.wait_idle(pids[ctl.name], [s.name for s in gpu_specs], timeout=60)
    out(f"local cluster up: controller + {nodes} GPU hosts x {gpus} GPUs "
        f"in {time.monotonic() - t0:.1f} s; inventory {layout.INVENTORY}")
    return inventory
