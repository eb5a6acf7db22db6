"""slurm-gpu: tasks that run on a deployed cluster (`fab --list` is the menu).

`fab train` targets the current Pulumi stack; `fab train --target local` the local
cluster (`fab local.up`). Every task here also takes --target, --stack and --identity
(ops/actions/cluster_task.py); what a task does lives in ops/.
"""

from __future__ import annotations

from invoke import Collection, task
from invoke.exceptions import Exit

from localcluster.tasks import ns as local_ns
from ops.actions import billing_status, netcheck, node_update, options, slurm, spot_requests, stack_down, status_view
from ops.actions import reconfigure as reconf
from ops.actions.cluster_task import cluster_task
from ops.cost import estimate as est
from ops.cost import fit
from ops.finetune import chat_session, runs, ship
from ops.finetune import follow as finetune_jobs
from ops.finetune import pipeline as finetune
from ops.ssh import sshcmd
from ops.ssh.remote import open_cluster


@cluster_task(help={
    "config": "training YAML (default: training/configs/qwen3-4b-lora.yaml; local-tiny.yaml locally)",
    "nodes": "GPU nodes to train on (default: all of them)",
    "gpus-per-node": "ranks per node, one per GPU (default: all GPUs of a node)",
    "examples": "train on the first N examples of the data set (default: from the config)",
    "model": "Hugging Face Hub ID or absolute path on the cluster of the base model",
    "data": ("a data file on this machine (uploaded once, by content hash), a Hub data set ID or an absolute "
             "path on the cluster (JSONL/JSON/CSV/Parquet)"),
    "raw": "stream the raw job log instead of compact progress lines",
    "estimate": "print each phase's predicted time and the run's cost, then stop (no host is touched)",
    "skip-check": "do not run the network check (all-reduce of every node) before the job",
    "healthy-only": "when the network check fails nodes, drain them and train on the others instead of stopping",
    "max-cost": "US dollars the run may cost: refused if the estimate is over; stops with a checkpoint before it",
    "down": "destroy the stack (pulumi destroy) once the adapters are home and verified, as `fab down`",
    "drop-unfinished": "with --down: destroy even though unfinished runs keep checkpoints on /scratch (they are lost)",
})
def train(c, where, config=None, nodes=None, gpus_per_node=None, examples=None, model=None, data=None, raw=False,
          estimate=False, skip_check=False, healthy_only=False, max_cost=None, down=False, drop_unfinished=False):
    """Fine-tune with LoRA across the cluster and bring the adapters home to runs/<job-id>/.

    Waits for cloud-init, shares the controller's munge key, returns nodes to service, runs a
    sanity job and the network check (`fab check`; --skip-check skips it), submits the fine-tune,
    streams its progress, prints the summary (loss, token accuracy, tokens/s, network check, NCCL
    transports) and downloads adapters, trainer state and a loss curve.
    Ctrl-C stops following; the job keeps running (`fab logs --job JOB` reattaches).
    --max-cost USD: refused when the estimate is over it; the job stops with a checkpoint before it passes it.
    Refused, before any node starts, when each GPU's predicted peak memory is over its size (docs/MEMORY.md).
    Without --down the summary ends with what the stack still bills and the command that stops it;
    --down destroys the stack once this and every finished run is home (checked before the run and after it;
    refused while another run is in flight, or while an unfinished run keeps checkpoints: --drop-unfinished).
    """
    opts = options.parse_train(where, config=config, nodes=nodes, gpus_per_node=gpus_per_node,
                               examples=examples, model=model, data=data, skip_check=skip_check,
                               healthy_only=healthy_only, max_cost=max_cost, down=down,
                               drop_unfinished=drop_unfinished)
    finetune.train(opts, raw=raw, estimate=estimate)


@cluster_task()
def check(c, where):
    """Check the network before a job: all-reduce across every GPU node's ranks, then per node pair.

    The fine-tune's own torch.distributed (NCCL over EFA on AWS, gloo locally) measures bus bandwidth
    and latency at a few message sizes; each pair is compared with what the instance type should give
    (ops/data/instances.json) and each node's transport (EFA or sockets) with what it should use. Prints
    a table per node pair, keeps runs/<job>/network.json; a node that fails is drained with the reason.
    `fab train` runs the same check first (--skip-check skips it).
    """
    with open_cluster(where) as cl:
        netcheck.check(cl, where.stack)


@cluster_task(help={
    "config": "training YAML (as `fab train`)", "nodes": "GPU nodes (default: the stack's)",
    "gpus-per-node": "ranks per node (default: all GPUs of a node)",
    "examples": "the first N examples of the data set (default: from the config)",
    "model": "base model (as `fab train`)", "data": "data set (as `fab train`)",
    "gpu-instance-type": "price another GPU type (with --region: no stack needed)",
    "region": "AWS region of the prices (default: the stack's aws:region)",
    "model-gb": "size of the model's weights in GB (for a model the estimate does not know)",
    "tokens-per-row": "mean tokens per training row (default: the benchmark's Alpaca rows)",
    "scratch-mbps": "throughput of the shared /scratch gp3 volume, MB/s (125 is free, above is billed)",
})
def estimate(c, where, config=None, nodes=None, gpus_per_node=None, examples=None, model=None, data=None,
             gpu_instance_type=None, region=None, model_gb=None, tokens_per_row=None, scratch_mbps=None):
    """Predict `fab train`'s phases and cost for the stack's cluster, model, data and config; touches no host.

    Three columns: a new stack (`pulumi up` to adapters home), the first `fab train` on a cluster
    (model and data downloaded), and `fab train` again (the nodes' page cache holds the weights).
    Cost: instances by the second at on-demand prices, NAT gateway hours and GB, EBS (ops/data/prices.json).
    Fit: each GPU's predicted peak memory (from the model's config.json alone) against the type's GPU memory, and
    when it does not fit, the cheapest change that would (docs/MEMORY.md).
    """
    opts = options.parse_train(where, config=config, nodes=nodes, gpus_per_node=gpus_per_node,
                               examples=examples, model=model, data=data)
    inv = est.load_inventory(opts.target, opts.stack) if not (gpu_instance_type and region) else None
    if inv is not None:
        options.check_against(opts, inv)
    plan = est.print_for_run(opts, inv, gpu_instance_type, region, model_gb, tokens_per_row, scratch_mbps)
    fit.estimate_report(opts, plan.cluster)  # each GPU's predicted peak memory against its size


@cluster_task()
def status(c, where):
    """Show the cluster's hosts (reachable or not, power state), Slurm's nodes (sinfo) and the queue (squeue).

    Power state per GPU node from sinfo's state flags: on, stopped (`~`, idle power-save),
    starting (`#`), stopping (`%`). Then the money: what the stack still bills per hour and per day, the
    command that stops it, and what it has cost since it was created at list prices (EC2's records and the
    controller's power log; needs the AWS credentials `pulumi` uses).
    """
    with open_cluster(where) as cl:
        try:
            status_view.show(cl)
        finally:  # a stack with a sick node bills too
            billing_status.show(cl, where)


@cluster_task(help={
    "drop-unfinished": "destroy even though unfinished runs (failed, cancelled) keep checkpoints on /scratch",
})
def down(c, where, drop_unfinished=False):
    """Destroy the stack (`pulumi destroy`) so nothing bills, once nothing on it is left to lose.

    The stack is --stack, else the selected one, settled once: the checks and the destroy name it.
    Refused, naming why, while a job is queued or running, while a finished run is not home in runs/
    with its adapters (adapter_config.json, adapter_model.*) equal (sha256) to the controller's
    (`fab logs --job N` brings one home), or while an unfinished run keeps checkpoints (--drop-unfinished
    accepts losing them). Then runs `pulumi destroy --yes --skip-preview` on the stack, shows its progress,
    lists what it removed and what may still bill. `pulumi destroy` alone checks none of this. The local
    cluster has `fab local.down`. `fab train --down` does the same after its run.
    """
    options.check_down(where.target)
    stack_down.down(where, runs.RUNS, drop_unfinished=bool(drop_unfinished))


@cluster_task(help={
    "run": "the run to merge, a directory name under runs/ as `fab runs` lists it (default: the newest run)",
    "download": "bring the merged model home to runs/<run>/merged/ (default: it stays on the cluster)",
})
def merge(c, where, run=None, download=False):
    """Merge a run's LoRA adapters into its base model on the cluster: a model any serving stack loads.

    A Slurm job on one GPU node writes bf16 safetensors, the tokenizer with its chat template and a model
    card (README.md: base model, data source and SHA-256, format, template, config, held-out results) into
    the run's folder on /scratch, `<job dir>/merged/`; plain `transformers` and vLLM load it. Prints its size
    and where it is. It stays on the cluster unless --download; the model card is kept in runs/<run>/ too.
    """
    found = ship.find_run(runs.RUNS, run)  # checked before any host is touched
    with open_cluster(where) as cl:
        ship.merge(cl, found, download=bool(download))


@cluster_task(help={"job": "job id (default: our latest fine-tune job)",
                    "progress": "compact progress lines instead of the raw log"})
def logs(c, where, job=None, progress=False):
    """Stream a fine-tune job's log (`--job N`) until it ends; when it completed, show the summary and download.

    Reattaches to a job after Ctrl-C in `fab train`: the log is shown from the start.
    """
    with open_cluster(where) as cl:
        finetune_jobs.follow(cl, job, progress=progress)


@cluster_task(help={"job": "job id (default: our latest running fine-tune job)"})
def cancel(c, where, job=None):
    """Cancel a fine-tune job with `--job N` (default: our latest one that is still queued or running)."""
    with open_cluster(where) as cl:
        finetune_jobs.cancel(cl, job)


@cluster_task(help={"force": "remove nodes from Slurm even while they run a job (cancels the job first)"})
def reconfigure(c, where, force=False):
    """Apply the stack's GPU node list to Slurm after `pulumi up` changed slurm-gpu:gpuNodeCount.

    Renders slurm.conf, gres.conf and the hosts block from the stack's inventory, installs them on
    the controller, restarts slurmctld and runs `scontrol reconfigure` (GPU nodes fetch the new
    configuration: they run configless); new nodes get the munge key and join. Refuses to remove a
    node that runs a job unless --force: drain it first (docs/AWS.md, "Scale"). No change: no restart.
    `fab train` runs this too.
    """
    with open_cluster(where) as cl:
        slurm.require_controller(cl, "be reconfigured")
        reconf.apply(cl, force=force)


@cluster_task()
def update_nodes(c, where):
    """Bring running GPU nodes up to date with this checkout's bootstrap, one idle node at a time.

    `pulumi up` never stops or replaces a running node for a code change; `fab status` names the
    nodes whose recorded bootstrap version differs from what this checkout renders ("behind").
    Each idle one is drained, gets the newly rendered files, runs the bootstrap steps that changed,
    records the new version and is resumed. A node with a job, or stopped by power saving, is
    skipped and named: run this again later. Nodes added by gpuNodeCount boot the current version;
    nodes that `pulumi up` replaced (image, key) boot the recorded one and need this.
    """
    with open_cluster(where) as cl:
        node_update.update(cl)


@cluster_task(positional=("host",), help={
    "host": "controller or a GPU node name, e.g. gpu-node-02 (see `fab status`)",
    "command": "run this command instead of an interactive shell",
})
def ssh(c, where, host=None, command=None):
    """Open a shell on a host: `fab ssh controller`, `fab ssh gpu-node-02` (through the controller).

    Runs OpenSSH with the stack's key, the controller as jump host, and the cluster's pinned
    host keys (StrictHostKeyChecking=yes): the same keys fab's own connections check.
    """
    rc = sshcmd.open_shell(where, host, command=command)
    if rc:
        raise Exit(code=rc)  # the remote command's own exit status


@cluster_task(help={
    "run": "the run to talk to, as `fab runs` lists it (default: the newest run with adapters)",
    "prompt": "answer this one prompt and stop (default: type prompts; an empty line ends)",
    "prompts-file": "answer every line of this text file (one prompt a line), the model loaded once",
    "max-new-tokens": "longest answer in tokens (default: 256)",
})
def chat(c, where, run=None, prompt=None, prompts_file=None, max_new_tokens=None):
    """Talk to a run's tuned adapters: prompts answered on one GPU node, the tokens streamed as they come.

    The run's adapters stay where the job wrote them on the cluster and load beside the base model they were
    trained on, in a Slurm step of one task on one node (the local cluster: the tiny model on CPU). Prompts
    are shaped as the run's rows were (Alpaca, prompt/completion, or the chat template), go through the step's
    stdin, never a command line, and each answer ends with its time to first token and tokens/s. The model
    loads once: --prompts-file and typed prompts after the first one answer without waiting for it.
    """
    opts = chat_session.parse(where, run=run, prompt=prompt, prompts_file=prompts_file,
                              max_new_tokens=max_new_tokens)
    chat_session.chat(opts)


@task(name="spot-requests", help={
    "region": "AWS region to look in (default: the AWS CLI's; the stack's aws:region)",
    "stack": "only this stack's requests: organization/slurm-gpu/STACK as `pulumi stack ls` shows it "
             "(default: every slurm-gpu stack's)",
})
def spot_requests_(c, region=None, stack=None):
    """List Spot requests of slurm-gpu stacks that are left over (still able to launch a billed instance).

    A spot node's persistent request is cancelled by the stack before the node is deleted
    (infra/spot_guard.py); this finds any that were not (an interrupted destroy, a stack from before
    that): one line a request, then the `aws ec2` commands that cancel it and terminate its instance.
    Works after `pulumi destroy`. Exit 1 when any is left over.
    """
    try:
        spot_requests.run(region, stack)
    except spot_requests.UserError as exc:
        raise Exit(f"fab spot-requests: {exc}", code=1) from None


@task(name="runs", help={"job": "show this run's summary again (a directory name under runs/, e.g. 12)"})
def runs_(c, job=None):
    """List the fine-tunes brought home under runs/, newest first; --job N shows one run's summary again.

    One line a run: job, date, model, training (+ held-out) rows, nodes x GPUs, final training loss, held-out
    loss of the base model -> the tuned adapters, tokens/s, wall time and, where the stack's prices give it,
    the instances' cost. Reads only local files; `tensorboard --logdir runs` compares the curves.
    """
    try:
        lines = runs.show(runs.RUNS, str(job)) if job else runs.table(runs.RUNS)
    except runs.RunsError as exc:
        raise Exit(f"fab runs: {exc}", code=2) from None
    print("\n".join(lines))


ns = Collection(train, check, estimate, status, logs, cancel, reconfigure, update_nodes, ssh, runs_,
                spot_requests_, down, chat, merge)
ns.add_collection(local_ns, "local")
