"""The steps of `fab train`, from a freshly deployed cluster to adapters in runs/<job-id>/.

Each step prints one short progress line; a step that fails on some hosts names them.
fabfile.py only parses flags and calls `run`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import posixpath
import re
import shlex
import stat
import tarfile
import time
import uuid
from pathlib import Path

from fabric import Connection

from cluster import targets
from cluster.errors import UserError
from cluster.inventory import Inventory
from ops.actions import cloudinit, fetch_files, munge, netcheck, node_update, prefetch, reconfigure, slurm, stack_down
from ops.actions import node_power as power
from ops.actions.options import REPO, TrainOptions, check_against
from ops.cost import cap as cost_cap
from ops.cost import estimate as est
from ops.cost import still_bills
from ops.finetune import gpu_events, stream, summary, timeline
from ops.finetune import sbatch as jobs
from ops.say import Say, shown
from ops.ssh.remote import Cluster, HostError, connect, each, service

# Where runs come home; SLURM_GPU_RUNS moves it (the tests keep the repo clean with it).
RUNS = Path(os.environ.get("SLURM_GPU_RUNS", REPO / "runs"))
TRAINING_DIR = REPO / "training"
TINY_DIR = "tiny"  # under scratch: made by training.make_tiny for the local cluster
STEPS = 7


class TrainError(UserError, RuntimeError):
    pass


def step(say: Say, n: int, text: str) -> None:
    say(f"[{n}/{STEPS}] {text}")


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


# ---------------------------------------------------------------- 4: sanity job


def new_job_dir(inv: Inventory) -> str:
    return f"{inv.scratch}/slurm-gpu/jobs/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def put_text(ctl: Connection, text: str, path: str, mode: int = 0o644) -> None:
    ctl.put(io.BytesIO(text.encode()), remote=path)
    ctl.sftp().chmod(path, mode)


def read_remote(ctl: Connection, path: str) -> str:
    with ctl.sftp().open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


_SANITY = re.compile(r"SANITY host=(?P<host>\S+) gpus=(?P<found>\d+) want=(?P<want>\d+) (?P<rest>.*)$")


def sanity(cl: Cluster, say: Say, timeout_s: float = 600) -> None:
    inv = cl.inventory
    nodes, gpus = len(inv.gpu_nodes), inv.gpus_per_node
    sdir = f"{inv.scratch}/slurm-gpu/sanity"
    script = f"{sdir}/sanity-{uuid.uuid4().hex[:8]}.sbatch"
    slurm.make_job_dir(cl.controller, inv, sdir)
    spec = jobs.base_spec(inv, jobs.SANITY_NAME, nodes, gpus, sdir, script_path=script)
    put_text(cl.controller, jobs.render_sanity(spec), script, 0o755)
    job_id = slurm.submit(cl.controller, script, user=slurm.job_user(inv))
    job = slurm.wait_job(cl.controller, job_id, timeout_s)
    log_path = f"{inv.scratch}/logs/{jobs.SANITY_NAME}-{job_id}.out"
    try:
        text = read_remote(cl.controller, log_path)
    except OSError:
        text = ""
    seen = {m["host"]: m for line in text.splitlines() if (m := _SANITY.search(line))}
    bad = {n.name: (f"{seen[n.name]['found']} of {gpus} GPUs" if n.name in seen else "no report")
           for n in inv.gpu_nodes if n.name not in seen or int(seen[n.name]["found"]) < gpus}
    if bad or not job.ok:
        detail = "\n".join(text.splitlines()[-20:])
        raise TrainError(f"sanity job {job_id} {job.state} (exit {job.exit_code}); "
                         + ("; ".join(f"{h}: {why}" for h, why in bad.items()) or "see the log")
                         + f"\n{log_path}:\n{detail}")
    per_node = ", ".join(f"{h} {m['found']} GPUs ({m['rest'].split()[0]})" for h, m in sorted(seen.items()))
    step(say, 4, f"sanity job {job_id}: {per_node}")


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


def check_network(cl: Cluster, stack: str | None, say: Say = print) -> netcheck.Checked:
    """`fab check`: nodes awake and idle, the check, its table; runs/<job>/network.json and timeline.json.
    A failed node is drained with the reason and the task fails naming it."""
    tl = timeline.Timeline(started=timeline.process_started(), cluster=cl.inventory.cluster_name)
    names = [n.name for n in cl.inventory.gpu_nodes]
    with tl.phase("wake"):
        power.wake(cl, say)
    with tl.phase("service"):  # down or earlier-drained nodes back to service, so every node is checked
        slurm.wait_idle(cl.controller, names, say=say)
    with tl.phase("network"):
        checked = netcheck.run(cl, stack, say)
    for line in netcheck.table(checked.verdict):
        say(line)
    dest = run_dir(checked.job_id, checked.check_dir)
    tl.job_id = checked.job_id
    netcheck.save(dest / "network.json", checked.verdict, checked.result, checked.job_id, checked.drained)
    tl.save(dest / "timeline.json")
    say(f"network check took {tl.seconds('network'):.1f} s; results in {dest}/network.json")
    if not checked.verdict.ok:
        drained = (f"; drained {', '.join(checked.drained)}: `fab train` returns them to service and checks "
                   "them again, or `scontrol update nodename=NODE state=resume` on the controller"
                   ) if checked.drained else ""
        raise netcheck.NetCheckError(f"{checked.verdict.problems()}{drained}")
    return checked


# ---------------------------------------------------------------- 5: the fine-tune


def training_tarball() -> bytes:
    """training/ as a tar.gz (no caches), so `-m training.train` imports from the job dir. Only
    regular files and folders under training/, each name one that stays inside the job dir
    (fetch_files.safe_name): the controller extracts it with `tar -xzf` (launch)."""
    buf = io.BytesIO()

    def keep(info: tarfile.TarInfo):
        name = info.name
        if "__pycache__" in name.split("/") or name.endswith(".pyc"):
            return None
        if not (info.isreg() or info.isdir()):
            raise TrainError(f"{TRAINING_DIR}: {name} is not a regular file or folder (a link?): "
                             "the training code is uploaded as plain files only; replace it with a file")
        fetch_files.safe_name(name, nested=True)
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(TRAINING_DIR, arcname="training", filter=keep)
    return buf.getvalue()


def exists(c: Connection, path: str) -> bool:
    return c.run(f"test -e {shlex.quote(path)}", hide=True, warn=True).ok


def ensure_tiny(cl: Cluster, job_dir: str, say: Say) -> tuple[str, str]:
    """The tiny model and data on /scratch for the local cluster, made once (atomically)."""
    inv = cl.inventory
    tiny = f"{inv.scratch}/{TINY_DIR}"
    model, data = tiny_paths(inv)
    node = cl.nodes[inv.gpu_nodes[0].name]
    if exists(node, f"{model}/config.json") and exists(node, data):
        say(f"      tiny model and data already in {tiny}")
        return model, data
    partial = f"{tiny}.partial-{uuid.uuid4().hex[:6]}"
    q = shlex.quote
    cmd = (f"cd {q(job_dir)} && {q(inv.python)} -m training.make_tiny --out {q(partial)} && "
           f"{{ mv -T {q(partial)} {q(tiny)} 2>/dev/null || rm -rf {q(partial)}; }}")
    res = node.run(cmd, hide=True, warn=True)
    if not res.ok or not exists(node, data):
        node.run(f"rm -rf {q(partial)}", hide=True, warn=True)
        raise TrainError(f"making the tiny model on {inv.gpu_nodes[0].name} failed: "
                         f"{(res.stderr or res.stdout).strip()[-800:]}")
    say(f"      made the tiny model and data in {tiny} (training.make_tiny)")
    return model, data


def tiny_paths(inv: Inventory) -> tuple[str, str]:
    """(model, data) that training.make_tiny makes on /scratch (named by local-tiny.yaml)."""
    tiny = f"{inv.scratch}/{TINY_DIR}"
    return f"{tiny}/model", f"{tiny}/data/train.jsonl"


def _where(opts: TrainOptions, flag: str) -> str:
    """How the user named the model or data: the flag, or the config's setting."""
    value = opts.model_path if flag == "model" else opts.data_path
    if getattr(opts, flag):
        return f"--{flag} {value}"
    key = "model_name_or_path" if flag == "model" else "dataset_name"
    return f"{key} {value} (from --config {opts.config.name})"


def check_data_on(node: Connection, python: str, data: str):
    """training/data.py's validation of `data`, run on `node` as that real file (copied to a
    temporary path: training/ is not uploaded yet)."""
    q = shlex.quote
    remote = f"/tmp/slurm-gpu-check-data-{uuid.uuid4().hex[:12]}.py"
    node.put(io.BytesIO((TRAINING_DIR / "data.py").read_bytes()), remote=remote)
    try:
        # -I: isolated. /tmp is every job's to write; without it Python would import a json.py a job
        # left beside the script, as the admin user (who has sudo).
        return node.run(f"{q(python)} -I {q(remote)} {q(data)}", hide=True, warn=True, in_stream=False)
    finally:
        node.run(f"rm -f {q(remote)}", hide=True, warn=True, in_stream=False)


def check_inputs(cl: Cluster, opts: TrainOptions, say: Say) -> None:
    """The model and data paths the job will read (flags, else the config's) exist on the
    cluster, the model is a model directory and the data file is valid training data.

    Runs before anything is written to /scratch or submitted, so a bad path or data
    file leaves no job directory and no job behind. The tiny model and data are made later.
    """
    inv, ctl = cl.inventory, cl.controller
    tiny = tiny_paths(inv)
    for flag, value in (("model", opts.model_path), ("data", opts.data_path)):
        if not value or not value.startswith("/") or value in tiny:
            continue
        if not exists(ctl, value):
            raise TrainError(f"{_where(opts, flag)}: no such path on the cluster (checked on the controller); "
                             f"copy it under {inv.scratch} first or fix the path")
        if flag == "model" and not exists(ctl, f"{value}/config.json"):
            raise TrainError(f"{_where(opts, flag)}: not a model directory (no config.json in it); give the "
                             "directory that `save_pretrained` wrote (config.json, weights, tokenizer)")
        # The job reads it as the jobs' user, not as the user that made it (safetensors saves 0600).
        res = slurm.as_job_user(ctl, slurm.job_user(inv), f"find {shlex.quote(value)} -maxdepth 1 ! -readable -print",
                                warn=True)
        if res.stdout.strip() or not res.ok:
            hidden = res.stdout.split("\n")[0].strip() or (res.stderr or "").strip()[:200]
            raise TrainError(f"{_where(opts, flag)}: the jobs' user {slurm.job_user(inv)} cannot read "
                             f"{shown(hidden)}; on the controller: sudo chmod -R a+rX {shlex.quote(value)}")
    data = opts.data_path
    if data and data.startswith("/") and data not in tiny:
        name = inv.gpu_nodes[0].name
        res = check_data_on(cl.nodes[name], inv.python, data)
        if not res.ok:
            why = (res.stderr or res.stdout).strip().splitlines() or [f"exit {res.exited}"]
            raise TrainError(f"{_where(opts, 'data')}: {why[-1]} (checked on {name} before uploading anything)")
        # stderr: "N valid rows, format F (...); left out: ..." (training/data.py main): the format is printed here.
        say(f"      {_where(opts, 'data')}: {(res.stderr or '').strip() or res.stdout.strip() + ' valid rows'}")


def launch(cl: Cluster, opts: TrainOptions, nodes: int, gpus: int, say: Say,
           submitted: list[str] | None = None, extra: dict[str, object] | None = None) -> tuple[str, str, str]:
    """Upload code, config and script; submit. Returns (job id, job dir, log path). `extra`: more
    training settings for the job's command line (the cost cap's).

    The job id is also appended to `submitted` as soon as Slurm gives it, so a Ctrl-C that
    lands before this returns can still say which job keeps running.
    """
    inv, ctl = cl.inventory, cl.controller
    q = shlex.quote
    job_dir = new_job_dir(inv)
    # The code, config and script are the admin user's, in a folder no job can write: the job runs as
    # the job user and writes only its work and output folders (docs/SECURITY.md).
    slurm.make_job_dir(ctl, inv, job_dir, jobs.WORK, jobs.OUTPUT)
    ctl.put(io.BytesIO(training_tarball()), remote=f"{job_dir}/training.tar.gz")
    # Our own archive (training_tarball: plain files under training/); GNU tar also skips ".." members
    # (https://www.gnu.org/software/tar/manual/html_node/absolute.html).
    ctl.run(f"tar --no-same-owner -xzf {q(job_dir)}/training.tar.gz -C {q(job_dir)} && rm {q(job_dir)}/training.tar.gz",
            hide=True)
    put_text(ctl, opts.config.read_text(), f"{job_dir}/config.yaml")

    # The job reads exactly what the flags or the config name; only the tiny model and data
    # (local-tiny.yaml's paths) are made here when missing, and that is said.
    flags: dict[str, object] = {"model_name_or_path": opts.model, "dataset_name": opts.data,
                                "n_examples": opts.examples, **(extra or {})}
    if {opts.model_path, opts.data_path} & set(tiny_paths(inv)):
        ensure_tiny(cl, job_dir, say)
    say(f"      model {_where(opts, 'model')}; data {_where(opts, 'data')}")
    spec = jobs.base_spec(inv, jobs.FINETUNE_NAME, nodes, gpus, job_dir,
                          script_path=f"{job_dir}/finetune.sbatch", config=f"{job_dir}/config.yaml",
                          output_dir=f"{job_dir}/{jobs.OUTPUT}", train_args=jobs.train_flags(flags))
    put_text(ctl, jobs.render_finetune(spec), spec.script_path, 0o755)
    # Held until a stale log of the same name is gone: job ids start again at 1 on a new local
    # cluster while /scratch/logs stays, and the job appends to its log (--open-mode=append, so a
    # requeued attempt keeps the first one's lines): an old file would be streamed as this job's.
    user = slurm.job_user(inv)
    job_id = slurm.submit(ctl, spec.script_path, "--hold", user=user)
    if submitted is not None:
        submitted.append(job_id)
    log_path = f"{inv.scratch}/logs/{jobs.FINETUNE_NAME}-{job_id}.out"
    released = slurm.as_job_user(ctl, user, f"rm -f {q(log_path)} && scontrol release {q(job_id)}", warn=True)
    if not released.ok:
        raise TrainError(f"job {job_id} is held and could not be released: "
                         f"{(released.stderr or released.stdout).strip()}; "
                         f"run `sudo -u {user} scontrol release {job_id}` on the controller or "
                         f"`fab cancel --job {job_id}`")
    step(say, 5, f"submitted job {job_id}: {nodes} node(s) x {gpus} rank(s), code and config in {job_dir}; "
                 f"log {log_path}")
    return job_id, job_dir, log_path


def reattach_hint(job_id: str, target: str) -> str:
    flag = targets.get(target).flag()
    return (f"\nStopped following job {job_id}; it keeps running on the cluster.\n"
            f"Reattach with `fab logs{flag} --job {job_id}`, or stop it with `fab cancel{flag} --job {job_id}`.")


# ---------------------------------------------------------------- 6-7: summary and artifacts


# Subdirectories of output_dir brought home with its files: TensorBoard's events (training/tensorboard_events.py),
# the hang watchdog's stacks and flight recorder dumps (training/hangs.py).
HOME_DIRS = ("tensorboard", "hangs")
# The files fab itself writes into runs/<job>/ beside the download (run_dir, finish, record_run,
# record_timeline, summary.plot_loss/plot_gpus): a job's file of the same name is not downloaded, so
# nothing the job wrote can overwrite or pre-fill fab's own records.
OWN_RECORDS = frozenset({"job_dir", "job.log", "run.json", "network.json", "timeline.json", "loss.png", "gpus.png"})
# What one run may bring home. Today's files: a LoRA's adapters (a 70B Llama's at rank 64 on every
# linear layer: 161,792 x 64 x 80 layers = 0.83 G parameters, 3.3 GB in fp32), the tokenizer,
# trainer_state.json, metrics.json, samples.md, the GPU samples, TensorBoard events and hang dumps
# (kilobytes to megabytes). 16 GiB a file holds such adapters up to rank ~300 in fp32; the caps stop
# a job's 1 TB file (sparse, or a link to /dev/zero swapped in) from filling this machine's disk.
# docs/AWS.md says so.
MAX_FILE_BYTES = 16 * 2**30
MAX_RUN_BYTES = 20 * 2**30
_CHUNK = 1 << 20


class _Budget:
    """The bytes a download may still take (MAX_RUN_BYTES in all)."""

    def __init__(self, total: int) -> None:
        self.left = total


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _copy_capped(sftp, remote: str, tmp: str, cap: int) -> str | None:
    """Copy `remote` to `tmp`, reading at most `cap` bytes; None when copied, else why not.

    The remote file is checked as it is opened (fstat of the open handle: a regular file within
    `cap`), so a listed file swapped for a link to a device or a larger file after the listing is
    refused, and the read stops at `cap` whatever the file grows to. `tmp` is created afresh, never
    through a symbolic link (O_NOFOLLOW, O_EXCL after removing a left-over)."""
    with sftp.open(remote, "rb") as f:
        st = f.stat()
        if not stat.S_ISREG(st.st_mode or 0):
            return "not a regular file when opened (replaced after the listing?)"
        if (st.st_size or 0) > cap:
            return f"{_gib(st.st_size)} when opened, over the cap of {_gib(cap)}"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        done = 0
        with os.fdopen(fd, "wb") as out:
            while chunk := f.read(min(_CHUNK, cap + 1 - done)):
                done += len(chunk)
                if done > cap:
                    break
                out.write(chunk)
    if done > cap:
        os.unlink(tmp)
        return f"grew past the cap of {_gib(cap)} while read"
    return None


def download(ctl: Connection, output_dir: str, dest: Path, say: Say = print) -> list[str]:
    """Top-level files of the run's output_dir (adapters, tokenizer, state, metrics, samples.md, GPU
    samples) and the files of HOME_DIRS (TensorBoard events); no checkpoints. A listed name that
    would leave `dest` (fetch_files.inside: "..", a separator, a symbolic link), or that is one of
    fab's own records (OWN_RECORDS), is not downloaded: `say` names it. The listing holds what the
    job wrote; symbolic links there are skipped (the SFTP server lists each entry's lstat: OpenSSH
    sftp-server.c process_readdir), and each file is lstat'ed again right before it is read and read
    with a byte cap (MAX_FILE_BYTES each, MAX_RUN_BYTES in all): a file over the cap is skipped."""
    sftp = ctl.sftp()
    dest.mkdir(parents=True, exist_ok=True)
    got = []
    budget = _Budget(MAX_RUN_BYTES)

    def fetch(remote_dir: str, name: str, rel: str) -> bool:
        try:
            local, tmp = fetch_files.inside(str(dest), rel), fetch_files.inside(str(dest), rel + ".part")
        except fetch_files.UnsafeName as exc:
            say(f"      not downloaded from {remote_dir}: {exc}")
            return False
        remote = posixpath.join(remote_dir, name)
        cap = min(MAX_FILE_BYTES, budget.left)
        try:
            st = sftp.lstat(remote)  # the listing is old news: the job may have swapped the file since
        except FileNotFoundError:
            say(f"      not downloaded from {remote_dir}: {name!r}: removed after the listing")
            return False
        if not stat.S_ISREG(st.st_mode or 0):
            why = "no longer a regular file (replaced after the listing)"
        elif (st.st_size or 0) > cap:
            why = f"{_gib(st.st_size)}, over the cap of {_gib(cap)} ({_gib(MAX_FILE_BYTES)} a file, " \
                  f"{_gib(MAX_RUN_BYTES)} a run)"
        else:
            why = _copy_capped(sftp, remote, tmp, cap)
        if why:
            say(f"      not downloaded from {remote_dir}: {name!r}: {why}")
            return False
        budget.left -= os.path.getsize(tmp)
        os.replace(tmp, local)
        return True

    try:
        entries = sftp.listdir_attr(output_dir)
    except FileNotFoundError:
        raise TrainError(f"{output_dir} is not on the cluster (removed?): nothing to download") from None
    for entry in entries:
        name = entry.filename
        if name in OWN_RECORDS:
            say(f"      not downloaded from {output_dir}: {name!r} is the name of fab's own record in {dest}")
        elif stat.S_ISREG(entry.st_mode or 0):
            if _single(name, output_dir, say) and fetch(output_dir, name, name):
                got.append(name)
        elif stat.S_ISDIR(entry.st_mode or 0) and name in HOME_DIRS:
            (dest / name).mkdir(exist_ok=True)
            remote = posixpath.join(output_dir, name)
            for inner in sftp.listdir_attr(remote):
                if (name, inner.filename) == ("tensorboard", gpu_events.SUBDIR):  # fab writes it (finish)
                    say(f"      not downloaded from {remote}: {inner.filename!r} is the name of fab's own "
                        f"record in {dest / name}")
                elif stat.S_ISREG(inner.st_mode or 0) and _single(inner.filename, remote, say):
                    fetch(remote, inner.filename, f"{name}/{inner.filename}")
            got.append(name + "/")
    return sorted(got)


def _single(name: str, remote_dir: str, say: Say) -> bool:
    """Whether an SFTP listing's `name` is one plain file name (fetch_files.safe_name); else say so."""
    try:
        fetch_files.safe_name(name)
    except fetch_files.UnsafeName as exc:
        say(f"      not downloaded from {remote_dir}: {exc}")
        return False
    return True


def run_dir(job_id: str, job_dir: str | None) -> Path:
    """runs/<job-id>/, unless it holds another job's run (a new local cluster numbers its jobs
    from 1 again): then runs/<job-id>-<job dir name>/, so no earlier run is overwritten."""
    dest = RUNS / job_id
    marker = dest / "job_dir"
    if job_dir and dest.exists() and (not marker.exists() or marker.read_text().strip() != job_dir):
        dest = RUNS / f"{job_id}-{posixpath.basename(job_dir)}"
    if job_dir:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "job_dir").write_text(job_dir + "\n")
    return dest


def finish(cl: Cluster, job_id: str, followed: stream.Followed, say: Say,
           job_dir: str | None = None, log_path: str | None = None,
           checked: netcheck.Checked | None = None, closing: list[str] | None = None) -> summary.RunSummary:
    """Print the summary and bring the run home to runs/<job-id>/. `closing`: the summary's last lines
    (what the stack still bills, or that --down takes it down)."""
    log, job = followed.log, followed.job
    job_dir = job_dir or log.job_dir
    dest = run_dir(job_id, job_dir)
    got: list[str] = []
    if job_dir:
        slurm.let_admin_read(cl.controller, cl.inventory, f"{job_dir}/output")
        got = download(cl.controller, f"{job_dir}/output", dest, say)
    if log_path:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "job.log").write_text(read_remote(cl.controller, log_path))
    try:
        run = summary.build(job_id, job.run_time if job else "", log, dest if got else None)
    except summary.SummaryError as exc:  # a record the job wrote is malformed: the run is still kept
        say(f"      warning: {exc}; the summary leaves the job's figures out")
        run = summary.build(job_id, job.run_time if job else "", dataclasses.replace(log, metrics=None), None)
    run.real_gpus, run.dest = targets.of(cl.inventory).real_gpus, dest
    run.closing = list(closing or [])
    if checked is not None:  # the check that preceded this run, kept beside it
        run.network = netcheck.summary_line(checked.verdict)
        netcheck.save(dest / "network.json", checked.verdict, checked.result, checked.job_id, checked.drained)
    step(say, 6, "summary")
    for line in run.lines(expect_efa=targets.of(cl.inventory).expects_efa(cl.inventory)):
        say(shown(line))  # values the job wrote (metrics.json, checkpoint names)
    png = summary.plot_loss(run.losses, dest / "loss.png", f"job {job_id} ({cl.inventory.cluster_name})") \
        if got or run.losses else None
    adapters = [f for f in got if f.startswith("adapter_")]
    gpus_png = summary.plot_gpus(run.gpus, dest / "gpus.png", f"job {job_id} GPUs") if run.gpus else None
    if run.gpus:
        gpu_events.write(dest)  # tensorboard/gpus/: the same samples as TensorBoard events
    extras = [f for f in ("samples.md", "tensorboard/") if f in got] + [p.name for p in (png, gpus_png) if p]
    step(say, 7, f"downloaded to {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}/: "
                 f"{', '.join(adapters) or 'no adapters'}, "
                 f"{', '.join(f for f in ('trainer_state.json', 'metrics.json') if f in got) or 'no state'}"
                 + "".join(f", {f}" for f in extras))
    if not adapters:
        raise TrainError(f"job {job_id} finished but {job_dir}/output holds no adapters")
    return run


def succeeded(followed: stream.Followed) -> bool:
    """COMPLETED in Slurm, or (when Slurm has already forgotten the job) final metrics in the log."""
    if followed.job is not None:
        return followed.job.ok
    return followed.log.metrics is not None


COMPLETED_MARKER = stack_down.COMPLETED_MARKER  # training/protocol.py's COMPLETED, written after the adapters


def training_completed(ctl: Connection, job_dir: str | None) -> bool:
    """Whether the run's output holds the completion marker (training finished, adapters written)."""
    return bool(job_dir) and exists(ctl, f"{job_dir}/output/{COMPLETED_MARKER}")


def outcome(cl: Cluster, job_id: str, followed: stream.Followed, job_dir: str | None, say: Say) -> bool:
    """True when the run is a success: Slurm says COMPLETED, or training wrote its completion
    marker before the job ended otherwise (a node lost at the very end): a finished run is kept."""
    if succeeded(followed):
        return True
    if training_completed(cl.controller, job_dir):
        job = followed.job
        state = f"{job.state} ({shown(job.reason)})" if job else "gone from Slurm"
        say(f"job {job_id} ended {state}, but its training had completed ({job_dir}/output/"
            f"{COMPLETED_MARKER} is there): the finished run is downloaded")
        return True
    return False


def failure(job_id: str, followed: stream.Followed, log_path: str) -> TrainError:
    job = followed.job
    state = f"{job.state} (exit {job.exit_code}, {shown(job.reason)})" if job else "gone from Slurm"
    errors = followed.log.errors
    cause = ("; the job log's error lines:\n" + "\n".join(f"  {shown(line)}" for line in errors)) if errors \
        else "; the job log has no error line (see its last lines)"
    tail = "\n".join(f"  {shown(line)}" for line in list(followed.log.tail)[-15:])
    return TrainError(f"job {job_id} {state}{cause}\nlast lines of {log_path}:\n{tail}")


def controller_lost(exc: slurm.ControllerUnreachable, job_id: str, target: str) -> TrainError:
    """Giving up on a job whose state slurmctld cannot tell: say how to reattach later."""
    return TrainError(f"{exc}.\nCheck slurmctld on the controller (`fab status`); once it answers, "
                      + reattach_hint(job_id, target).strip().split("\n", 1)[1])


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
    tl.timed("inputs", check_inputs, cl, opts, say)
    opts = tl.timed("prefetch", prefetch.fetch_inputs, cl, opts, say)  # Hub IDs -> copies on /scratch
    changed = tl.timed("keys", sync_munge_key, cl, say)
    if cl.inventory.facts:  # older inventories carry no facts: their slurm.conf came with the stack
        # The stack's node list, after `pulumi up` changed it (a no-op when nothing changed).
        tl.timed("reconfigure", reconfigure.apply, cl, say=lambda s: say("      " + s))
    tl.timed("service", nodes_to_service, cl, changed, say)
    tl.timed("sanity", sanity, cl, say)
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
            job_id, job_dir, log_path = launch(cl, opts, nodes, gpus, say, submitted, cap)
        with tl.phase("queue") as follow:  # split into the job's own phases once it has ended
            followed = stream.follow(cl.controller, job_id, log_path, say=lambda s: say("      " + s), raw=raw)
    except KeyboardInterrupt:
        if submitted:
            say(reattach_hint(submitted[0], cl.inventory.target))
        raise
    except slurm.ControllerUnreachable as exc:
        raise controller_lost(exc, job_id, cl.inventory.target) from None
    if not outcome(cl, job_id, followed, job_dir, lambda s: say("      " + s)):
        raise failure(job_id, followed, log_path)
    result = tl.timed("download", finish, cl, job_id, followed, say, job_dir, log_path, checked, closing)
    record_timeline(tl, follow, result, run_dir(job_id, job_dir), say, predicted)
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
            if opts.max_cost:
                cost = _check_cap(opts, plan, est.scenario_for(RUNS, inv.cluster_name) if inv else "first")
                say(f"  fits --max-cost ${opts.max_cost:.2f}: estimated at ${cost:.2f}")
            return None
        if opts.down:  # one stack for the inventory, the checks and the destroy (stack_down's module doc)
            opts = dataclasses.replace(opts, stack=stack_down.stack_name(opts.stack))
        inv = targets.load(opts.target, opts.stack)
        nodes, gpus = check_against(opts, inv)
        say(f"fab train: {inv.target} cluster {inv.cluster_name!r}, {nodes} node(s) x {gpus} GPU(s) "
            f"({inv.gpu_type}), config {opts.config.name}")
        tl.cluster = inv.cluster_name
    predicted, plan = None, None
    with tl.phase("estimate"):
        try:  # the prediction beside the timeline; a cluster the estimate cannot price still trains
            plan = est.for_run(opts, inv)
            predicted = plan.predicted(est.scenario_for(RUNS, inv.cluster_name))
        except est.EstimateError as exc:
            if opts.max_cost:  # no estimate, no price: the cap cannot be held
                raise TrainError(f"--max-cost needs the run's estimate and prices, which failed: {exc}") from None
            say(f"note: no estimate for this run ({exc})")
        cost_per_h = None
        if opts.max_cost and plan is not None:  # refused here, before any host is touched
            cost = _check_cap(opts, plan, est.scenario_for(RUNS, inv.cluster_name))
            cost_per_h = cost_cap.rate_per_h(plan.cluster)
            say(f"      --max-cost ${opts.max_cost:.2f}: estimated at ${cost:.2f}; the job stops with a checkpoint "
                f"before it would pass the cap (${cost_per_h:.2f}/h while it runs)")
    closing = closing_lines(opts, plan)
    with tl.phase("setup"):
        cl = connect(inv, opts.identity)
    try:
        if opts.down:  # before any training: another run in flight, or one not home, refuses here already
            stack_down.check_ready(cl, RUNS, "--down", opts.stack, drop_unfinished=opts.drop_unfinished)
        result = run(cl, opts, nodes, gpus, say=say, raw=raw, tl=tl, predicted=predicted, cost_per_h=cost_per_h,
                     closing=closing)
        if result.dest is not None:
            write_run_record(result.dest, opts, inv, nodes, gpus, tl.wall_s, plan)
        if opts.down:  # this run and every earlier finished one home, their adapters verified
            try:
                ready = stack_down.check_ready(cl, RUNS, "--down", opts.stack, done_job=result.job_id,
                                               drop_unfinished=opts.drop_unfinished)
            except stack_down.DownRefused:  # the stack stays up: say what it bills
                for line in closing_lines(dataclasses.replace(opts, down=False), plan):
                    say(line)
                raise
    finally:
        cl.close()
    if opts.down:
        say("--down: " + stack_down.ready_line(ready, RUNS))
        stack_down.destroy(opts.stack, inv, say)
    return result


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


def write_run_record(dest: Path, opts: TrainOptions, inv: Inventory, nodes: int, gpus: int, wall_s: float,
                     plan) -> None:
    """runs/<job>/run.json: what `fab runs` lists beside metrics.json and timeline.json (the run's model,
    data, cluster shape and, where the stack's prices give it, the instances' cost over the wall time)."""
    cost = None
    if plan is not None and not plan.cluster.calibrated:
        cl = plan.cluster
        try:
            per_h = cl.billed_nodes * est.price_per_h(cl.region, cl.gpu_type) + \
                est.price_per_h(cl.region, cl.controller_type)
            cost = round(per_h * wall_s / 3600, 4)
        except est.EstimateError:
            cost = None
    record = {"target": inv.target, "cluster": inv.cluster_name, "gpu_type": inv.gpu_type, "nodes": nodes,
              "gpus_per_node": gpus, "config": opts.config.name, "model": opts.model_path, "data": opts.data_path,
              "wall_s": round(wall_s, 3), "cost_usd": cost}
    (dest / "run.json").write_text(json.dumps(record, indent=2) + "\n")


def record_timeline(tl: timeline.Timeline, follow: timeline.Phase, result: summary.RunSummary, dest: Path,
                    say: Say, predicted: dict[str, float] | None) -> None:
    """The job's phases into the timeline; print it (beside the estimate) and keep runs/<job>/timeline.json."""
    log = dest / "job.log"
    tl.job_id = result.job_id
    timeline.add_job(tl, follow, result.metrics, log.read_text() if log.exists() else "")
    for line in tl.table(predicted):
        say(line)
    tl.save(dest / "timeline.json", predicted)
