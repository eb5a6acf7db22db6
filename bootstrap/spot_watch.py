#!/usr/bin/python3
"""The spot interruption watcher: a GPU node's service (slurm-gpu-spot-watch) that polls the instance
metadata service and, on a notice, has the running job checkpoint between optimizer steps.

- Interruption notice (spot/instance-action: terminate, stop or hibernate at a time): drain this node
  with the reason "spot interruption: ACTION at TIME", then send SIGUSR1 to this node's training
  ranks of each job running here. The training saves a checkpoint on every rank at the end of the
  step in progress and exits; the job script requeues the job, which resumes from that checkpoint
  once enough nodes are back.
- Rebalance recommendation (events/recommendations/rebalance): SIGUSR2 only: a checkpoint at once,
  training goes on, the node is not drained.
- The ranks are signalled directly (training_pids), not by `scancel --signal`: with
  ProctrackType=proctrack/cgroup (AWS) slurmstepd sends a signal other than SIGKILL only to the
  step's own tasks unless cgroup.conf has SignalChildrenProcesses=yes (Slurm's proctrack_cgroup.c,
  cgroup.conf(5)); the task is torchrun's agent, which ignores these signals (the job script's
  wrapper) and forwards none (torch/distributed/elastic/multiprocessing/api.py handles only
  TORCHELASTIC_SIGNALS_TO_HANDLE, by stopping the workers). A rank that starts while a notice stands
  (after a requeue, or still loading) gets it on the next poll.
- At start (the node is back after a stop), once the service answers with no notice: a node this
  watcher drained ("spot interruption: ..." reason) is resumed.

AWS: the notice appears two minutes before the stop or termination (at once for hibernation) and
AWS recommends checking every 5 seconds; absent, the item answers 404
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html). The
rebalance item holds {"noticeTime": ...}
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html). IMDSv2: PUT
/latest/api/token with X-aws-ec2-metadata-token-ttl-seconds gives a token that each GET sends as
X-aws-ec2-metadata-token; an expired one answers 401
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html).

Settings (environment, from /etc/slurm-gpu/spot-watch.env): SLURM_GPU_IMDS (the service's base URL,
default http://169.254.169.254), SLURM_GPU_SPOT_POLL_S (default 5), SLURM_GPU_NODE (Slurm node name,
default the host name). Python's standard library only: it runs on the system python3.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

DEFAULT_IMDS = "http://169.254.169.254"
TOKEN_TTL_S = 21600  # the most IMDSv2 grants (six hours)
TOKEN_MARGIN_S = 60  # refresh this long before it expires
INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
ACTIONS = ("terminate", "stop", "hibernate")
REASON_PREFIX = "spot interruption:"
# The signals the training handles between steps (training/interrupts.py).
SIGNAL = {"interruption": "USR1", "rebalance": "USR2"}
TRAINING_MODULE = b"training.train"  # the ranks run `python -u -m training.train` (torchrun's workers)
AGENT_MODULE = b"torch.distributed.run"  # torchrun's agent names both: never it
# A configless slurmd keeps the cluster's config here; client commands run by a service need it.
CONFIGLESS_CONF = "/run/slurm/conf/slurm.conf"


class ImdsError(Exception):
    """The metadata service answered something the watcher cannot use."""


@dataclass(frozen=True)
class Notice:
    kind: str  # "interruption" or "rebalance"
    action: str  # terminate, stop, hibernate; "rebalance" for a recommendation
    time: str  # when (interruption) or when noticed (rebalance), as the service says

    @property
    def reason(self) -> str:
        return f"{REASON_PREFIX} {self.action} at {self.time}"


def parse_instance_action(body: str) -> Notice:
    """spot/instance-action's JSON: {"action": "terminate"|"stop"|"hibernate", "time": ISO 8601}."""
    try:
        data = json.loads(body)
        action, when = data["action"], data["time"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ImdsError(f"spot/instance-action is not {{action, time}} JSON: {body[:200]!r}") from exc
    if action not in ACTIONS:
        # An action AWS may add later is still an interruption: checkpoint and drain all the same.
        print(f"spot-watch: unknown action {action!r}; handled as an interruption", flush=True)
    return Notice("interruption", str(action), str(when))


def parse_rebalance(body: str) -> Notice:
    """events/recommendations/rebalance's JSON: {"noticeTime": ISO 8601}."""
    try:
        when = json.loads(body)["noticeTime"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ImdsError(f"events/recommendations/rebalance is not {{noticeTime}} JSON: {body[:200]!r}") from exc
    return Notice("rebalance", "rebalance", str(when))


class Imds:
    """IMDSv2 client: a session token, refreshed before it expires or when refused (401)."""

    def __init__(self, base: str = DEFAULT_IMDS, timeout: float = 2.0, clock=time.monotonic):
        if not base.startswith("http://"):
            raise ValueError(f"SLURM_GPU_IMDS must be an http:// URL (got {base!r})")
        self.base, self.timeout, self.clock = base.rstrip("/"), timeout, clock
        self.token: str | None = None
        self.expires = 0.0
        self.tokens = 0  # tokens fetched (tests read it)

    def _token(self) -> str:
        if self.token is None or self.clock() >= self.expires - TOKEN_MARGIN_S:
            req = urllib.request.Request(self.base + "/latest/api/token", method="PUT",
                                         headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                self.token = resp.read().decode().strip()
            self.expires = self.clock() + TOKEN_TTL_S
            self.tokens += 1
        return self.token

    def get(self, path: str) -> str | None:
        """The item's text; None when the service says there is none (404)."""
        for attempt in (1, 2):
            req = urllib.request.Request(self.base + path, headers={"X-aws-ec2-metadata-token": self._token()})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return resp.read().decode()
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return None
                if exc.code == 401 and attempt == 1:  # the token expired or was revoked: a new one
                    self.token = None
                    continue
                raise ImdsError(f"{path}: HTTP {exc.code}") from exc
        raise AssertionError("unreachable")

    def notices(self) -> list[Notice]:
        """The notices standing now: an interruption first (it supersedes a rebalance)."""
        out = []
        if (body := self.get(INSTANCE_ACTION)) is not None:
            out.append(parse_instance_action(body))
        if (body := self.get(REBALANCE)) is not None:
            out.append(parse_rebalance(body))
        return out


def slurm(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if "SLURM_CONF" not in env and os.path.exists(CONFIGLESS_CONF):
        env["SLURM_CONF"] = CONFIGLESS_CONF
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, env=env, check=False)


def training_pids(job: str, node: str, proc: str = "/proc") -> list[int]:
    """The training ranks of `job` on `node`: processes running `-m training.train` (not torchrun's
    agent) whose environment (from srun's task, inherited through torchrun) names the job and node."""
    want = {f"SLURM_JOB_ID={job}".encode(), f"SLURMD_NODENAME={node}".encode()}
    pids = []
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if TRAINING_MODULE not in argv or AGENT_MODULE in argv:
                continue
            with open(f"{proc}/{entry}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
        except OSError:  # gone, or not ours to read
            continue
        if want <= env:
            pids.append(int(entry))
    return sorted(pids)


class Watcher:
    """What to do about the notices; each notice is acted on once."""

    def __init__(self, imds: Imds, node: str, run=slurm, say=None, find_pids=None):
        self.imds, self.node, self.run = imds, node, run
        self.say = say or (lambda msg: print(msg, flush=True))
        self.find_pids = find_pids or training_pids
        self.seen: set[Notice] = set()
        self.signalled: dict[Notice, set[int]] = {}  # the rank pids each notice has reached
        self.started = False

    def jobs_here(self) -> list[str]:
        res = self.run("squeue", "-h", "-w", self.node, "-t", "RUNNING", "-o", "%A")
        return res.stdout.split() if res.returncode == 0 else []

    def act(self, notice: Notice) -> None:
        if notice.kind == "interruption":
            # Drain first: nothing new is scheduled here, and the reason tells fab and the user why.
            res = self.run("scontrol", "update", f"nodename={self.node}", "state=DRAIN", f"reason={notice.reason}")
            self.say(f"spot-watch: {notice.reason}: drained {self.node}" if res.returncode == 0
                     else f"spot-watch: drain of {self.node} failed: {res.stderr.strip()}")
        else:
            self.say(f"spot-watch: rebalance recommendation at {notice.time}: checkpoint only, no drain")

    def signal_ranks(self, notice: Notice) -> None:
        """This node's training ranks of the jobs running here that this notice has not reached yet."""
        sig = getattr(signal, "SIG" + SIGNAL[notice.kind])
        done = self.signalled.setdefault(notice, set())
        for job in self.jobs_here():
            for pid in set(self.find_pids(job, self.node)) - done:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:  # it ended meanwhile
                    continue
                done.add(pid)
                self.say(f"spot-watch: job {job}: SIG{SIGNAL[notice.kind]} to rank pid {pid}")

    def resume_if_ours(self) -> bool:
        """Back after an interruption with no notice standing: undo this watcher's drain. False while
        Slurm does not answer yet (slurmd, munge and /scratch come up after this service): try again."""
        res = self.run("sinfo", "-h", "-n", self.node, "-o", "%E")
        if res.returncode != 0:
            return False
        if res.stdout.strip().startswith(REASON_PREFIX):
            res = self.run("scontrol", "update", f"nodename={self.node}", "state=RESUME")
            self.say(f"spot-watch: {self.node} is back; resumed it" if res.returncode == 0
                     else f"spot-watch: resume of {self.node} failed: {res.stderr.strip()}")
        return True

    def poll(self) -> list[Notice]:
        notices = self.imds.notices()
        if not notices and not self.started:
            self.started = self.resume_if_ours()
        elif notices:
            self.started = True  # a notice stands: not back from an interruption of ours
        new = [n for n in notices if n not in self.seen]
        if any(n.kind == "interruption" for n in notices):  # one signal: the interruption's checkpoint covers both
            new = [n for n in new if n.kind == "interruption"]
            standing = [n for n in notices if n.kind == "interruption"]
        else:
            standing = notices
        for notice in new:
            self.act(notice)
        for notice in standing:  # the ranks of each standing notice, new ones included
            self.signal_ranks(notice)
        self.seen.update(notices)
        return new


def main() -> int:
    base = os.environ.get("SLURM_GPU_IMDS") or DEFAULT_IMDS
    try:
        poll_s = float(os.environ.get("SLURM_GPU_SPOT_POLL_S") or 5)
        imds = Imds(base)
    except ValueError as exc:
        print(f"spot-watch: {exc}; fix /etc/slurm-gpu/spot-watch.env", file=sys.stderr)
        return 2
    node = os.environ.get("SLURM_GPU_NODE") or socket.gethostname().split(".")[0]
    watcher = Watcher(imds, node)
    print(f"spot-watch: watching {base} every {poll_s:g} s for node {node}", flush=True)
    failing = False
    while True:
        try:
            watcher.poll()
            if failing:
                print("spot-watch: the metadata service answers again", flush=True)
            failing = False
        except (OSError, ImdsError) as exc:  # not reachable yet, or a bad answer: keep watching
            if not failing:
                print(f"spot-watch: {base}: {exc}; retrying every {poll_s:g} s", flush=True)
            failing = True
        sys.stdout.flush()
        time.sleep(poll_s)


if __name__ == "__main__":
    sys.exit(main())
