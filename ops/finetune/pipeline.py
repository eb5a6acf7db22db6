"""The steps of `fab train`, from a freshly deployed cluster to adapters in runs/<job-id>/.

Each step prints one short progress line; a step that fails on some hosts names them.
fabfile.py only parses flags and calls `train`. What a step needs beyond its own sequence lives in
the step's module: inputs.py (the model and data checked), sanity.py (the sanity job), the network
check (ops/actions/netcheck.py), launch.py (upload and submit), job_end.py (how the job ended) and
run_home.py (summary, download).
"""

from __future__ import annotations

import dataclasses

from cluster import targets
from ops.actions import cloudinit, munge, netcheck, node_update, prefetch, reconfigure, slurm, stack_down
from ops.actions import node_power as power
from ops.actions.options import TrainOptions, check_against
from ops.cost import cap as cost_cap
from ops.cost import estimate as est
from ops.cost import fit, still_bills
from ops.finetune import inputs, job_end, launch, run_home, runs, sanity, stream, summary, timeline, upload
from ops.finetune.trainstep import TrainError, step
from ops.say import Say
from ops.ssh.remote import Cluster, HostError, connect, each, service

# ---------------------------------------------------------------- 1-3: the cluster


def wait_cloud_init(cl: Cluster, say: Say) -> None:
    hosts = {"controller": cl.controller, **cl.nodes}
    if not targets.of(cl.inventory).cloud_init:
        step(say, 1, f"cloud-init: skipped (the {cl.inventory.target} cluster is configured by `fab local.up`); "
                     "checking every host's bootstrap steps")
        # A host whose bootstrap step failed is named with the step and its log's last lines.
        each("bootstrap", hosts, lambda n, c: cloudinit.check_bootstrap(c))
        return
    step(say, 1, f"cloud-init: waiting for {len(cl.inventory.nodes)} hosts to finish booting")
    # In parallel: a failed bootstrap step on any host ends the wait at its next poll.
    each("cloud-init", hosts, lambda n, c: cloudinit.wait_done(c))


def sync_munge_key(cl: Cluster, say: Say) -> list[str]:
    """Give every node the controller's key; return the nodes whose key changed."""
    inv = cl.inventory
    before = each("reading the munge key", cl.nodes, lambda n, c: munge.key_digest(c))
    try:
        result = munge.distribute_key(cl.controller, cl.nodes, inv.service_cmd)
    except munge.MungeKeyError as exc:
        raise HostError("munge key", {exc.node: str(exc).split(": ", 1)[-1]}) from exc
    changed = sorted(result.installed)
    if not changed:
        step(say, 2, f"munge key: skipped every node ({', '.join(sorted(result.skipped))} already match "
                     "the controller's key); credentials decode everywhere")
        return changed
    notes = [f"{n} ({'repaired: it had a different key' if before.get(n) else 'installed: it had none'})"
             for n in changed]
    text = "munge key: " + ", ".join(notes)
    if result.skipped:
        text += f"; skipped {', '.join(sorted(result.skipped))} (already matching)"
    step(say, 2, text + "; a controller credential now decodes on every node")
    return changed


def nodes_to_service(cl: Cluster, changed: list[str], say: Say, timeout_s: float = 180) -> None:
    inv = cl.inventory
    if changed:
        each("restarting slurmd", {n: cl.nodes[n] for n in changed},
             lambda n, c: service(c, inv, "restart", "slurmd"))
    names = [n.name for n in inv.gpu_nodes]
    slurm.wait_idle(cl.controller, names, timeout_s=timeout_s, say=say)
    restarted = f"restarted slurmd on {', '.join(changed)}; " if changed else ""
    step(say, 3, f"slurm: {restarted}all {len(names)} nodes idle ({', '.join(names)})")


# ---------------------------------------------------------------- 4: the network check (the sanity job: sanity.py)


def network_check(cl: Cluster, opts: TrainOptions, nodes: int, say: Say) -> tuple[netcheck.Checked, int]:
    """The all-reduce check of every node (ops/actions/netcheck.py): failed nodes are drained; the run stops
    with the reason unless --healthy-only, then it goes on with fewer nodes. Returns (check, nodes)."""
    checked = netcheck.run(cl, opts.stack, say)
    v = checked.verdict
    for line in netcheck.table(v):
        say("      " + line)
    step(say, 4, f"network check job {checked.job_id}: {netcheck.summary_line(v)}")
    if v.ok:
        return checked, nodes
    drained = (f"; drained {', '.join(checked.drained)} (sinfo -R shows why; the next `fab train` returns "
               "them to service and checks them again)") if checked.drained else ""
    flag = targets.of(cl.inventory).flag()
    if not opts.healthy_only or v.unattributed or not v.healthy:
        raise TrainError(f"network check job {checked.job_id}: {v.problems()}{drained}. Nothing was submitted. "
                         f"Fix the node(s) and run `fab check{flag}`; or pass --healthy-only to train on the nodes "
                         "that passed (when the check could name the bad ones), or --skip-check to train anyway")
    use = min(nodes, len(v.healthy))
    say(f"      --healthy-only: training on {use} of the {len(v.healthy)} node(s) that passed "
        f"({', '.join(v.healthy)}){drained}")
    return checked, use


# ---------------------------------------------------------------- 5-7: the job (launch.py), its end (job_end.py),
# the run home (run_home.py)


def run(cl: Cluster, opts: TrainOptions, nodes: int, gpus: int, say: Say = print,
        raw: bool = False, tl: timeline.Timeline | None = None,
        predicted: dict[str, float] | None = None, cost_per_h: float | None = None,
        closing: list[str] | None = None) -> summary.RunSummary:
    tl = tl or timeline.Timeline()  # every step below is one phase of the run's timeline
    with tl.phase("wake"):
        power.wake(cl, say)  # every later step reaches the nodes over SSH
        wait_cloud_init(cl, say)
        behind = node_update.behind_warning(cl)  # e.g. nodes replaced by `pulumi up` boot older user-data
        if behind:
            say(behind)
    tl.timed("inputs", inputs.check_inputs, cl, opts, say)
    opts = tl.timed("prefetch", prefetch.fetch_inputs, cl, opts, say)  # Hub IDs -> copies on /scratch
    changed = tl.timed("keys", sync_munge_key, cl, say)
    # The stack's node list, after `pulumi up` changed it (a no-op when nothing changed).
    tl.timed("reconfigure", reconfigure.apply, cl, say=lambda s: say("      " + s))
    tl.timed("service", nodes_to_service, cl, changed, say)
    tl.timed("sanity", sanity.sanity, cl, say)
    checked = None
    if not opts.skip_check:
        checked, nodes = tl.timed("network", network_check, cl, opts, nodes, say)
    submitted: list[str] = []
    try:
        with tl.phase("staging"):
            tl.clock_offset_s = timeline.clock_offset(cl.controller)
            # The cap counts from fab's start (on the cluster's clock): the steps before training cost too.
            cap = cost_cap.train_flags(opts.max_cost, cost_per_h, tl.started + tl.clock_offset_s) \
                if opts.max_cost and cost_per_h else None
            job_id, job_dir, log_path = launch.launch(cl, opts, nodes, gpus, say, submitted, cap)
        with tl.phase("queue") as follow:  # split into the job's own phases once it has ended
            followed = stream.follow(cl.controller, job_id, log_path, say=lambda s: say("      " + s), raw=raw)
    except KeyboardInterrupt:
        if submitted:
            say(job_end.reattach_hint(submitted[0], cl.inventory.target))
        raise
    except slurm.ControllerUnreachable as exc:
        raise job_end.controller_lost(exc, job_id, cl.inventory.target) from None
    if not job_end.outcome(cl, job_id, followed, job_dir, lambda s: say("      " + s)):
        raise job_end.failure(job_id, followed, log_path)
    result = tl.timed("download", run_home.finish, cl, job_id, followed, say, job_dir, log_path, checked, closing)
    result.data = run_home.data_digest(cl.controller, opts.data_path)  # the copy it read (after prefetch)
    run_home.record_timeline(tl, follow, result, runs.run_dir(job_id, job_dir), say, predicted)
    return result


def train(opts: TrainOptions, say: Say = print, raw: bool = False,
          estimate: bool = False) -> summary.RunSummary | None:
    """`fab train`: the options checked against the cluster's inventory (read locally, before any host is
    touched), then `run` over the cluster's connections, every phase in the run's timeline. `estimate`:
    print the predicted phases and cost and stop (from the stack's settings; no host is touched)."""
    tl = timeline.Timeline(started=timeline.process_started())  # the run's wall time: from fab's start
    with tl.phase("setup", start=tl.started):
        if estimate:
            inv = est.load_inventory(opts.target, opts.stack)
            plan = est.print_for_run(opts, inv)
            fit.estimate_report(opts, plan.cluster, say=say)
            if opts.max_cost:
                cost = _check_cap(opts, plan, est.scenario_for(runs.RUNS, inv.cluster_name) if inv else "first")
                say(f"  fits --max-cost ${opts.max_cost:.2f}: estimated at ${cost:.2f}")
            return None
        if opts.down:  # one stack for the inventory, the checks and the destroy (stack_down's module doc)
            opts = dataclasses.replace(opts, stack=stack_down.stack_name(opts.stack))
        local = _local_data(opts)  # read and checked here, before the inventory or any host
        inv = targets.load(opts.target, opts.stack)
        nodes, gpus = check_against(opts, inv)
        say(f"fab train: {inv.target} cluster {inv.cluster_name!r}, {nodes} node(s) x {gpus} GPU(s) "
            f"({inv.gpu_type}), config {opts.config.name}")
        if local is not None:
            say(f"      --data: local file {local.describe()}")
        tl.cluster = inv.cluster_name
    predicted, plan = None, None
    with tl.phase("estimate"):
        try:  # the prediction beside the timeline; a cluster the estimate cannot price still trains
            plan = est.for_run(opts, inv)
            predicted = plan.predicted(est.scenario_for(runs.RUNS, inv.cluster_name))
        except est.EstimateError as exc:
            if opts.max_cost:  # no estimate, no price: the cap cannot be held
                raise TrainError(f"--max-cost needs the run's estimate and prices, which failed: {exc}") from None
            say(f"note: no estimate for this run ({exc})")
        # Does it fit the GPUs' memory: refused here, before any host is touched (a Hub model's config.json is
        # read from here; the local cluster's CPU run is only reported)
        model, priced = opts.model_path or "", fit_cluster(opts, inv, plan, say)
        if priced is not None and (priced.calibrated or not model.startswith("/")):
            check_fit(opts, priced, None, say)
        cost_per_h = None
        if opts.max_cost and plan is not None:  # refused here, before any host is touched
            cost = _check_cap(opts, plan, est.scenario_for(runs.RUNS, inv.cluster_name))
            cost_per_h = cost_cap.rate_per_h(plan.cluster)
            say(f"      --max-cost ${opts.max_cost:.2f}: estimated at ${cost:.2f}; the job stops with a checkpoint "
                f"before it would pass the cap (${cost_per_h:.2f}/h while it runs)")
    closing = closing_lines(opts, plan)
    with tl.phase("setup"):
        cl = connect(inv, opts.identity)
    try:
        if priced is not None and not priced.calibrated and model.startswith("/"):  # read on the controller:
            with tl.phase("estimate"):  # no node woken
                check_fit(opts, priced, cl.controller, say)
        if local is not None:  # to the controller (always on), before any node is woken
            opts = tl.timed("upload", upload_data, cl, opts, local, say)
        if opts.down:  # before any training: another run in flight, or one not home, refuses here already
            stack_down.check_ready(cl, runs.RUNS, "--down", opts.stack, drop_unfinished=opts.drop_unfinished)
        result = run(cl, opts, nodes, gpus, say=say, raw=raw, tl=tl, predicted=predicted, cost_per_h=cost_per_h,
                     closing=closing)
        if result.dest is not None:
            run_home.write_run_record(result.dest, opts, inv, nodes, gpus, tl.wall_s, plan, result.data)
        if opts.down:  # this run and every earlier finished one home, their adapters verified
            try:
                ready = stack_down.check_ready(cl, runs.RUNS, "--down", opts.stack, done_job=result.job_id,
                                               drop_unfinished=opts.drop_unfinished)
            except stack_down.DownRefused:  # the stack stays up: say what it bills
                for line in closing_lines(dataclasses.replace(opts, down=False), plan):
                    say(line)
                raise
    finally:
        cl.close()
    if opts.down:
        say("--down: " + stack_down.ready_line(ready, runs.RUNS))
        stack_down.destroy(opts.stack, inv, say)
    return result


def _local_data(opts: TrainOptions) -> upload.LocalData | None:
    """--data naming a file on this machine: read (streaming) and its first rows checked (ops/finetune/upload.py)."""
    if not opts.data_file:
        return None
    try:
        local = upload.prepare(opts.data_file)
    except upload.UploadError as exc:
        raise TrainError(str(exc)) from None
    return local


def upload_data(cl: Cluster, opts: TrainOptions, local: upload.LocalData, say: Say) -> TrainOptions:
    """The local data file on the cluster's scratch (uploaded unless already there); the options naming it."""
    path, uploaded = upload.ensure_on_cluster(cl.controller, cl.inventory.scratch, local, say)
    return dataclasses.replace(opts, data=path, data_source=local.record(path, uploaded))


def fit_cluster(opts: TrainOptions, inv, plan: est.Estimate | None, say: Say) -> est.PricedCluster | None:
    """The cluster the fit check measures against: the estimate's, else the stack's type and the run's ranks
    (an estimate fails for a model whose weights' size it does not know; its config.json still gives the fit)."""
    if plan is not None:
        return plan.cluster
    try:
        return est.cluster_for(opts.target, opts.stack, inv, opts.nodes, opts.gpus_per_node)
    except est.EstimateError as exc:
        say(f"note: no fit check for this run ({exc})")
        return None


def check_fit(opts: TrainOptions, cluster: est.PricedCluster, controller, say: Say) -> None:
    """Each GPU's predicted peak memory against its size (ops/cost/fit.py): a run that cannot fit is refused
    before any node starts; on the local cluster (CPU) only reported."""
    try:
        fit.refuse_unless_fits(fit.report(opts, cluster, controller, say=say), opts.model_path or "")
    except fit.FitError as exc:
        raise TrainError(str(exc)) from None


def closing_lines(opts: TrainOptions, plan: est.Estimate | None) -> list[str]:
    """The summary's last lines: what the stack bills once the run is home (every GPU node on, idle until power
    saving stops it), and the command that stops it; with --down, that it comes down."""
    if opts.down:
        return ["  stack         --down: `pulumi destroy` once the adapters are home and verified"]
    if plan is None or plan.cluster.calibrated:  # the local cluster bills nothing; no prices: nothing to say
        return []
    cl = plan.cluster
    return still_bills.lines(still_bills.still_billing(cl, nodes_on=cl.billed_nodes, nodes_stopped=0,
                                                       stack=opts.stack))


def _check_cap(opts: TrainOptions, plan: est.Estimate, scenario: str) -> float:
    """The run's estimated cost, or a TrainError when it is over --max-cost (ops/cost/cap.py)."""
    try:
        return cost_cap.check_before_launch(plan, scenario, opts.max_cost)
    except cost_cap.CostCapError as exc:
        raise TrainError(str(exc)) from None

