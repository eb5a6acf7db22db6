"""slurm-gpu: tasks that run on a deployed cluster (`fab --list` is the menu).

`fab train` targets the current Pulumi stack; `fab train --target local` the local
cluster (`fab local.up`).
"""

from __future__ import annotations

import functools
import shlex
import subprocess

from invoke import Collection, task
from invoke.exceptions import Exit
from paramiko.ssh_exception import AuthenticationException, NoValidConnectionsError, SSHException

from localcluster.tasks import ns as local_ns
from ops import cloudinit, hostkeys, inventory, jobs, munge, options, power, prefetch, slurm, sshcmd, stream, timeline
from ops import estimate as est
from ops import finetune as flow
from ops import reconfigure as reconf
from ops.cloudinit import CloudInitFailed
from ops.remote import Cluster, HostError, connect, each

_USER_ERRORS = (options.OptionError, inventory.InventoryError, HostError, slurm.SlurmError,
                munge.MungeKeyError, CloudInitFailed, flow.TrainError, reconf.ReconfigureError,
                hostkeys.HostKeyError, est.EstimateError,
                prefetch.PrefetchError)


def _clean_errors(fn):
    """Known failures end the task with their message (no traceback), exit code 1."""

    @functools.wraps(fn)
    def wrapper(c, *args, **kwargs):
        try:
            return fn(c, *args, **kwargs)
        except _USER_ERRORS as exc:
            raise Exit(f"fab {fn.__name__}: {exc}", code=1) from None
        except AuthenticationException as exc:
            key = kwargs.get("identity") or "the inventory's ssh_key_file"
            raise Exit(f"fab {fn.__name__}: the cluster refused the SSH key ({key}): {exc} The cluster is "
                       "reachable; the key is wrong. Pass --identity with the private key whose public half "
                       "the cluster was deployed with (slurm-gpu:sshPublicKey; locally the inventory's key).",
                       code=1) from None
        except (NoValidConnectionsError, SSHException, TimeoutError) as exc:
            raise Exit(f"fab {fn.__name__}: cannot reach the cluster ({exc}). Is it up (`fab status`, "
                       "`fab local.up`, `pulumi up`), and is your address inside slurm-gpu:adminCidr?",
                       code=1) from None
        except KeyboardInterrupt:
            raise Exit(code=130) from None

    return wrapper


def _identity(c, identity):
    """--identity, else `fab -i KEY` (Fabric's own flag), else the inventory's key."""
    if identity:
        return identity
    keys = c.config.connect_kwargs.get("key_filename") if hasattr(c, "config") else None
    return (keys[0] if isinstance(keys, list) and keys else keys) or None


def _cluster(c, target, stack, identity) -> tuple[Cluster, str]:
    """Connections to the cluster, the controller's opened: a wrong key or a down host fails here,
    by its own cause, before the task does anything."""
    opts = options.parse_cluster(target=target, stack=stack, identity=_identity(c, identity))
    inv = inventory.load(opts.target, opts.stack)
    cl = connect(inv, opts.identity)
    cl.controller.open()
    return cl, opts.target


@task(help={
    "target": "aws (the current Pulumi stack, default) or local (the cluster of `fab local.up`)",
    "stack": "Pulumi stack to read the inventory from (default: the selected stack)",
    "config": "training YAML (default: training/configs/qwen3-4b-lora.yaml; local-tiny.yaml locally)",
    "nodes": "GPU nodes to train on (default: all of them)",
    "gpus-per-node": "ranks per node, one per GPU (default: all GPUs of a node)",
    "examples": "train on the first N examples of the data set (default: from the config)",
    "model": "Hugging Face Hub ID or absolute path on the cluster of the base model",
    "data": "Hub data set ID or absolute path on the cluster (JSON/JSONL/Parquet, Alpaca columns)",
    "identity": "SSH private key (default: the inventory's ssh_key_file)",
    "raw": "stream the raw job log instead of compact progress lines",
    "estimate": "print each phase's predicted time and the run's cost, then stop (no host is touched)",
})
@_clean_errors
def train(c, target=None, stack=None, config=None, nodes=None, gpus_per_node=None, examples=None,
          model=None, data=None, identity=None, raw=False, estimate=False):
    """Fine-tune with LoRA across the cluster and bring the adapters home to runs/<job-id>/.

    Waits for cloud-init, shares the controller's munge key, returns nodes to service, runs a
    sanity job, submits the fine-tune, streams its progress, prints the summary (loss, token
    accuracy, tokens/s, NCCL transports) and downloads adapters, trainer state and a loss curve.
    Ctrl-C stops following; the job keeps running (`fab logs --job JOB` reattaches).
    """
    tl = timeline.Timeline()  # the run's wall time starts here
    with tl.phase("setup"):
        opts = options.parse(target=target, stack=stack, config=config, nodes=nodes,
                             gpus_per_node=gpus_per_node, examples=examples, model=model, data=data,
                             identity=_identity(c, identity))
        if estimate:  # from the stack's settings where its inventory cannot be read: no host is touched
            est.print_for_run(opts, est.load_inventory(opts.target, opts.stack))
            return
        inv = inventory.load(opts.target, opts.stack)
        n_nodes, gpus = options.check_against(opts, inv)
        print(f"fab train: {inv.target} cluster {inv.cluster_name!r}, {n_nodes} node(s) x {gpus} GPU(s) "
              f"({inv.gpu_type}), config {opts.config.name}")
        tl.cluster = inv.cluster_name
    predicted = None
    with tl.phase("estimate"):
        try:  # the prediction beside the timeline; a cluster the estimate cannot price still trains
            scenario = est.scenario_for(flow.RUNS, inv.cluster_name)
            predicted = est.for_run(opts, inv).predicted(scenario)
        except est.EstimateError as exc:
            print(f"note: no estimate for this run ({exc})")
    with tl.phase("setup"):
        cl = connect(inv, opts.identity)
    try:
        flow.run(cl, opts, n_nodes, gpus, raw=raw, tl=tl, predicted=predicted)
    finally:
        cl.close()


@task(help={
    "target": "aws (the stack's settings, default) or local",
    "stack": "Pulumi stack whose Pulumi.<stack>.yaml is read (default: the only one)",
    "config": "training YAML (as `fab train`)", "nodes": "GPU nodes (default: the stack's)",
    "gpus-per-node": "ranks per node (default: every GPU)", "examples": "rows to train on (default: the config's)",
    "model": "base model (Hub ID or path, as `fab train`)", "data": "data set (as `fab train`)",
    "gpu-instance-type": "price another GPU type (with --region: no stack needed)",
    "region": "AWS region of the prices (default: the stack's aws:region)",
    "model-gb": "size of the model's weights in GB (for a model the estimate does not know)",
    "tokens-per-row": "mean tokens per training row (default: the benchmark's Alpaca rows)",
    "scratch-mbps": "throughput of the shared /scratch gp3 volume, MB/s (125 is free, above is billed)",
})
@_clean_errors
def estimate(c, target=None, stack=None, config=None, nodes=None, gpus_per_node=None, examples=None, model=None,
             data=None, gpu_instance_type=None, region=None, model_gb=None, tokens_per_row=None, scratch_mbps=None):
    """Predict `fab train`'s phases and cost for the stack's cluster, model, data and config; touches no host.

    Three columns: a new stack (`pulumi up` to adapters home), the first `fab train` on a cluster
    (model and data downloaded), and `fab train` again (the nodes' page cache holds the weights).
    Cost: instances by the second at on-demand prices, NAT gateway hours and GB, EBS (ops/data/prices.json).
    """
    opts = options.parse(target=target, stack=stack, config=config, nodes=nodes, gpus_per_node=gpus_per_node,
                         examples=examples, model=model, data=data)
    inv = est.load_inventory(opts.target, opts.stack) if not (gpu_instance_type and region) else None
    if inv is not None:
        options.check_against(opts, inv)
    est.print_for_run(opts, inv, gpu_instance_type, region, model_gb, tokens_per_row, scratch_mbps)


@task(help={"target": "aws (default) or local", "stack": "Pulumi stack", "identity": "SSH private key"})
@_clean_errors
def status(c, target=None, stack=None, identity=None):
    """Show the cluster's hosts (reachable or not, power state), Slurm's nodes (sinfo) and the queue (squeue).

    Power state per GPU node from sinfo's state flags: on, stopped (`~`, idle power-save),
    starting (`#`), stopping (`%`).
    """
    cl, _ = _cluster(c, target, stack, identity)
    inv = cl.inventory
    try:
        print(f"{inv.target} cluster {inv.cluster_name!r}: {len(inv.gpu_nodes)} GPU node(s) x "
              f"{inv.gpus_per_node} {inv.gpu_type}")
        ctld_up = False
        try:
            ctld_up = slurm.controller_up(cl.controller)  # sinfo would retry for a minute without it
            powers = (power.node_power(cl.controller) or {}) if ctld_up else {}
        except (OSError, SSHException):  # reported below: the controller does not answer
            powers = {}
        idle_stop = inv.extra.get("idle_stop_s")
        print(f"  idle GPU nodes stop after {idle_stop // 60 or idle_stop} "
              f"{'min' if idle_stop >= 60 else 's'} (power saving)" if idle_stop else
              "  idle GPU nodes never stop (power saving off)")
        # A stopped node has no SSH to probe: its power state says it all.
        stopped = {n for n, p in powers.items() if p == "stopped"}
        conns = {"controller": cl.controller, **{n: c for n, c in cl.nodes.items() if n not in stopped}}
        up: dict[str, str] = {}
        try:
            up = each("ssh", conns, lambda n, conn: conn.run("uptime -p || true", hide=True).stdout.strip())
        except HostError as exc:
            # A jump host (the controller) that cannot be reached is reported under its own key,
            # before any host ran anything: then no host is reachable.
            jump = next((why for host, why in exc.failures.items() if host not in conns), None)
            up = {n: f"UNREACHABLE: {exc.failures.get(n, jump)}" if n in exc.failures or jump else "up"
                  for n in conns}
        for node in inv.nodes:
            addr = node.public_ip or node.private_ip
            pw = f"power {powers[node.name]}" if node.name in powers else ""
            text = "(no SSH while stopped; the next job starts it)" if node.name in stopped else up.get(node.name, "?")
            print(f"  {node.name:<14} {node.role:<10} {addr:<16} {pw:<22} {text}")
        if up.get("controller", "").startswith("UNREACHABLE"):
            raise Exit("fab status: the controller is unreachable", code=1)
        failed_boot = _bootstrap_failures({n: c for n, c in conns.items()
                                           if not up.get(n, "").startswith("UNREACHABLE")})
        for name, why in failed_boot.items():
            print(f"note: {name}: {why}")
        if failed_boot:
            raise Exit(f"fab status: the first boot failed on {', '.join(failed_boot)} (above: the step and "
                       "the end of its log)", code=1)
        if not ctld_up:
            restart = inv.service_cmd.format(action="restart", service="slurmctld")
            raise Exit("fab status: slurmctld is DOWN on the controller (`scontrol ping`); jobs may still "
                       f"run on the nodes. Restart it there (`{restart}`) and check its log "
                       "(/var/log/slurm/slurmctld.log)", code=1)
        print(cl.controller.run("sinfo -N -o '%N %9T %G %E'", hide=True, warn=True).stdout.rstrip())
        print(cl.controller.run("squeue -o '%.8i %.22j %.8u %.10T %.10M %.6D %R'", hide=True,
                                warn=True).stdout.rstrip())
        sick = [n for n in slurm.node_states(cl.controller).values()
                if n.needs_resume or n.health_drained or n.state.endswith("*")]
        for n in sick:
            print(f"note: {n.name} is {n.state}" + (f" ({n.reason})" if n.reason else "") + f": {_node_fix(n)}")
        if sick:
            raise Exit(f"fab status: {len(sick)} of {len(inv.gpu_nodes)} GPU node(s) not in service", code=1)
    finally:
        cl.close()


def _bootstrap_failures(conns: dict) -> dict[str, str]:
    """host -> its failed bootstrap step and the end of that step's log (hosts that answer)."""
    try:
        found = each("bootstrap status", conns, lambda n, conn: cloudinit.bootstrap_failure(conn))
    except HostError as exc:  # a host that cannot be read is not a failed boot: reported elsewhere
        found = {n: None for n in conns if n not in exc.failures}
    return {n: why for n, why in sorted(found.items()) if why}


def _node_fix(n: slurm.NodeState) -> str:
    resume = f"`scontrol update nodename={n.name} state=resume` on the controller"
    if n.health_drained:
        return f"the GPU health check drained it; fix the GPU, then {resume}"
    if n.state.endswith("*"):
        return "its slurmd does not answer the controller; start slurmd there (`fab train` restarts and resumes nodes)"
    return f"`fab train` resumes it, or {resume}"


def _latest_job(cl: Cluster, running_only: bool = False) -> str:
    known = slurm.jobs_named(cl.controller, jobs.FINETUNE_NAME)
    if running_only:
        known = [j for j in known if not j.finished]
    if known:
        return known[-1].id
    if not running_only:
        logs = f"{cl.inventory.scratch}/logs"
        out = cl.controller.run(f"ls {shlex.quote(logs)} 2>/dev/null", hide=True, warn=True).stdout
        ids = [int(name[len(jobs.FINETUNE_NAME) + 1:-4]) for name in out.split()
               if name.startswith(jobs.FINETUNE_NAME + "-") and name.endswith(".out")
               and name[len(jobs.FINETUNE_NAME) + 1:-4].isdigit()]
        if ids:
            return str(max(ids))
    what = "running fine-tune job" if running_only else "fine-tune job"
    raise flow.TrainError(f"no {what} of ours on this cluster; start one with `fab train`")


def _require_controller(cl: Cluster, doing: str) -> None:
    """slurmctld must answer before `doing`: a down controller is named with its fix, not misread."""
    if not slurm.controller_up(cl.controller):
        restart = cl.inventory.service_cmd.format(action="restart", service="slurmctld")
        raise slurm.ControllerUnreachable(
            f"slurmctld is DOWN on the controller (`scontrol ping`), so it cannot {doing}; jobs may still run "
            f"on the nodes. Restart it there (`{restart}`, log /var/log/slurm/slurmctld.log), then run this again")


def _job_arg(job) -> str | None:
    if job is None:
        return None
    job = str(job).strip()
    if not job.isdigit() or int(job) == 0:  # Slurm job ids start at 1
        raise options.OptionError(f"--job must be a Slurm job id (a number), not {job!r}; see `fab status`")
    return job


@task(help={"job": "job id (default: our latest fine-tune job)", "target": "aws (default) or local",
            "stack": "Pulumi stack", "identity": "SSH private key",
            "progress": "compact progress lines instead of the raw log"})
@_clean_errors
def logs(c, job=None, target=None, stack=None, identity=None, progress=False):
    """Stream a fine-tune job's log (`--job N`) until it ends; when it completed, show the summary and download.

    Reattaches to a job after Ctrl-C in `fab train`: the log is shown from the start.
    """
    job = _job_arg(job)
    cl, tgt = _cluster(c, target, stack, identity)
    try:
        job = job or _latest_job(cl)
        log_path = f"{cl.inventory.scratch}/logs/{jobs.FINETUNE_NAME}-{job}.out"
        print(f"fab logs: job {job}, {log_path}")
        known = slurm.job(cl.controller, job)
        if known is None and not flow.exists(cl.controller, log_path):
            raise flow.TrainError(f"no job {job} on this cluster: Slurm does not know it and there is no "
                                  f"log {log_path}; `fab status` lists the queue")
        if known is not None and not known.name.startswith(jobs.FINETUNE_NAME):
            raise flow.TrainError(f"job {job} is {known.name!r}, not a fine-tune job of `fab train`; "
                                  f"its output is {known.stdout or 'unknown'}")
        try:
            followed = stream.follow(cl.controller, job, log_path, raw=not progress)
        except KeyboardInterrupt:
            print(flow.reattach_hint(job, tgt))
            raise
        except slurm.ControllerUnreachable as exc:
            raise flow.controller_lost(exc, job, tgt) from None
        ok = flow.outcome(cl, job, followed, followed.log.job_dir, print)
        if ok and followed.log.job_dir:
            flow.finish(cl, job, followed, print, log_path=log_path)
        elif not ok:
            raise flow.failure(job, followed, log_path)
    finally:
        cl.close()


@task(help={"job": "job id (default: our latest running fine-tune job)", "target": "aws (default) or local",
            "stack": "Pulumi stack", "identity": "SSH private key"})
@_clean_errors
def cancel(c, job=None, target=None, stack=None, identity=None):
    """Cancel a fine-tune job with `--job N` (default: our latest one that is still queued or running)."""
    job = _job_arg(job)
    cl, _ = _cluster(c, target, stack, identity)
    try:
        _require_controller(cl, "cancel a job")
        job = job or _latest_job(cl, running_only=True)
        was = slurm.cancel(cl.controller, job)
        print(f"fab cancel: cancelled job {job} ({was.name}, was {was.state})")
    finally:
        cl.close()


@task(help={"target": "aws (default) or local", "stack": "Pulumi stack", "identity": "SSH private key",
            "force": "remove nodes from Slurm even while they run a job (cancels the job first)"})
@_clean_errors
def reconfigure(c, target=None, stack=None, identity=None, force=False):
    """Apply the stack's GPU node list to Slurm after `pulumi up` changed slurm-gpu:gpuNodeCount.

    Renders slurm.conf, gres.conf and the hosts block from the stack's inventory, installs them on
    the controller, restarts slurmctld and runs `scontrol reconfigure` (GPU nodes fetch the new
    configuration: they run configless); new nodes get the munge key and join. Refuses to remove a
    node that runs a job unless --force: drain it first (README, "Scale"). No change: no restart.
    `fab train` runs this too.
    """
    cl, _ = _cluster(c, target, stack, identity)
    try:
        _require_controller(cl, "be reconfigured")
        reconf.apply(cl, force=force)
    finally:
        cl.close()


@task(positional=["host"], help={
    "host": "controller or a GPU node name, e.g. gpu-node-02 (see `fab status`)",
    "command": "run this command instead of an interactive shell",
    "target": "aws (default) or local", "stack": "Pulumi stack", "identity": "SSH private key",
})
@_clean_errors
def ssh(c, host=None, command=None, target=None, stack=None, identity=None):
    """Open a shell on a host: `fab ssh controller`, `fab ssh gpu-node-02` (through the controller).

    Runs OpenSSH with the stack's key, the controller as jump host, and the cluster's pinned
    host keys (StrictHostKeyChecking=yes): the same keys fab's own connections check.
    """
    name = "" if host is None else str(host).strip()
    if not name:  # before the inventory: the fix does not depend on the cluster
        raise options.OptionError("name the host to open a shell on: `fab ssh controller` or `fab ssh gpu-node-01` "
                                  "(`fab status` lists the GPU nodes)")
    opts = options.parse_cluster(target=target, stack=stack, identity=_identity(c, identity))
    inv = inventory.load(opts.target, opts.stack)
    pins = hostkeys.Pins(inv)
    argv = sshcmd.ssh_argv(inv, name, pins.path, identity=opts.identity or inv.ssh_key_file, command=command)
    for needed in {inv.controller.name, name}:
        pins.keys(needed)  # pinned (or read from the EC2 console output) before ssh runs
    rc = subprocess.run(argv).returncode  # stdio inherited: interactive as ssh itself
    if rc == 255:  # OpenSSH's own failure code (connection refused, auth, host key), above its lines
        raise Exit(f"fab ssh: ssh to {name} failed (exit 255, ssh's own error above): is {name} up and its sshd "
                   f"running? `fab status` shows the nodes; restart sshd on {name} from the cloud console "
                   "(locally: `fab local.down && fab local.up`)", code=1)
    if rc:
        raise Exit(code=rc)


ns = Collection(train, estimate, status, logs, cancel, reconfigure, ssh)
ns.add_collection(local_ns, "local")
