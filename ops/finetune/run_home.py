"""Steps 6-7 of `fab train` (and `fab logs` once a job completed): the run's summary, and its output brought
home to runs/<job-id>/ (capped, never outside that folder, never over fab's own records); the run's record
and timeline beside it."""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import re
import shlex
import stat
from pathlib import Path

from fabric import Connection

from cluster import targets
from cluster.inventory import Inventory
from ops.actions import fetch_files, netcheck, slurm
from ops.actions.options import REPO, TrainOptions
from ops.cost import estimate as est
from ops.finetune import gpu_events, runs, stream, summary, timeline
from ops.finetune.trainstep import TrainError, step
from ops.say import Say, shown
from ops.ssh.remote import Cluster, read_remote

# Subdirectories of output_dir brought home with its files: TensorBoard's events (training/tensorboard_events.py),
# the hang watchdog's stacks and flight recorder dumps (training/hangs.py).
HOME_DIRS = ("tensorboard", "hangs")
# The files fab itself writes into runs/<job>/ beside the download (run_dir, finish, record_run,
# record_timeline, summary.plot_loss/plot_gpus): a job's file of the same name is not downloaded, so
# nothing the job wrote can overwrite or pre-fill fab's own records.
OWN_RECORDS = frozenset({"job_dir", "job.log", "run.json", "network.json", "timeline.json", "loss.png", "gpus.png",
                         "README.md", "merged.json", "merged"})  # the last three: fab merge's in runs/<run>/ (ship.py)
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


def job_owner(inv) -> int | None:
    """The uid whose files a job's output holds, where the job's user is not the admin fab logs in as:
    a file fab opens there owned by anyone else is a link the job swapped in to another user's file
    (the SFTP server follows links on open). None where jobs run as the login user (the local cluster,
    a stack from before jobs had their own user): there is no other user to read for."""
    return None if inv.facts.job_user == inv.facts.ssh_user else inv.facts.job_uid


def _copy_capped(sftp, remote: str, tmp: str, cap: int, owner: int | None = None) -> str | None:
    """Copy `remote` to `tmp`, reading at most `cap` bytes; None when copied, else why not.

    The remote file is checked as it is opened (fstat of the open handle: a regular file within
    `cap`, owned by `owner` when given), so a listed file swapped for a link to a device, a larger
    file or another user's file after the listing is refused, and the read stops at `cap` whatever
    the file grows to. `tmp` is created afresh, never through a symbolic link (O_NOFOLLOW, O_EXCL
    after removing a left-over)."""
    with sftp.open(remote, "rb") as f:
        st = f.stat()
        if not stat.S_ISREG(st.st_mode or 0):
            return "not a regular file when opened (replaced after the listing?)"
        if owner is not None and st.st_uid != owner:
            return f"owned by uid {st.st_uid}, not the job's user (uid {owner}) when opened (a link swapped in?)"
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


def download(ctl: Connection, output_dir: str, dest: Path, say: Say = print, owner: int | None = None,
             reserved: frozenset[str] = OWN_RECORDS) -> list[str]:
    """Top-level files of the run's output_dir (adapters, tokenizer, state, metrics, samples.md, GPU
    samples) and the files of HOME_DIRS (TensorBoard events); no checkpoints. A listed name that
    would leave `dest` (fetch_files.inside: "..", a separator, a symbolic link), or that is one of
    fab's own records (OWN_RECORDS), is not downloaded: `say` names it. The listing holds what the
    job wrote; symbolic links there are skipped (the SFTP server lists each entry's lstat: OpenSSH
    sftp-server.c process_readdir), and each file is lstat'ed again right before it is read and read
    with a byte cap (MAX_FILE_BYTES each, MAX_RUN_BYTES in all): a file over the cap is skipped.
    `owner` (job_owner): the uid every file read must belong to as it is opened. `reserved`: the names
    fab writes itself in `dest` (a run's folder: OWN_RECORDS; the merged model's folder holds none)."""
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
            why = _copy_capped(sftp, remote, tmp, cap, owner)
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
        if name in reserved:
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


def finish(cl: Cluster, job_id: str, followed: stream.Followed, say: Say,
           job_dir: str | None = None, log_path: str | None = None,
           checked: netcheck.Checked | None = None, closing: list[str] | None = None) -> summary.RunSummary:
    """Print the summary and bring the run home to runs/<job-id>/. `closing`: the summary's last lines
    (what the stack still bills, or that --down takes it down)."""
    log, job = followed.log, followed.job
    job_dir = job_dir or log.job_dir
    dest = runs.run_dir(job_id, job_dir)
    got: list[str] = []
    if job_dir:
        slurm.let_admin_read(cl.controller, cl.inventory, f"{job_dir}/output")
        got = download(cl.controller, f"{job_dir}/output", dest, say, owner=job_owner(cl.inventory))
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



def data_digest(ctl: Connection, path: str | None) -> dict | None:
    """{"path", "sha256"} of the data a run read on the cluster (None: no path, or unreadable), for run.json and
    the model card (`fab merge`). A file: its own SHA-256 (`sha256sum FILE`). A folder (a Hub data set's copy):
    the SHA-256 of the `sha256sum` lines of its files, sorted by path (LC_ALL=C), as
    `cd DIR && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum` prints it."""
    if not path or not path.startswith("/"):
        return None
    q = shlex.quote(path)
    cmd = (f"if [ -d {q} ]; then cd {q} && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum "
           f"| sha256sum; else sha256sum -- {q}; fi")
    res = ctl.run(f"bash -c {shlex.quote('set -o pipefail; ' + cmd)}", hide=True, warn=True, in_stream=False)
    digest = (res.stdout.split() or [""])[0] if res.ok else ""
    return {"path": path, "sha256": digest} if re.fullmatch(r"[0-9a-f]{64}", digest) else None


def write_run_record(dest: Path, opts: TrainOptions, inv: Inventory, nodes: int, gpus: int, wall_s: float,
                     plan, data: dict | None = None) -> None:
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
              "wall_s": round(wall_s, 3), "cost_usd": cost,
              # what the run read: the copy on the cluster and its content hash (data_digest)
              "data_on_cluster": (data or {}).get("path"), "data_sha256": (data or {}).get("sha256")}
    if opts.data_source:  # where the data came from (a local file: its sha256; ops/finetune/upload.py)
        record["data_source"] = dict(opts.data_source)
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
