"""The spot interruption watcher (bootstrap/spot_watch.py) against a stand-in metadata service on loopback,
its files in the GPU node's render, the training's "checkpoint now" signal handling, and fab's words."""

import ast
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from bootstrap import node_layout, render, spot_watch, user_data
from cluster.facts import DEFAULT_IMDS
from ops.finetune.joblog import JobLog
from tests.support.imds_standin import serve_in_thread
from tests.unit.test_bootstrap_render import FACTS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def imds(tmp_path):
    """(state file, server, client) of a stand-in on 127.0.0.1."""
    state = tmp_path / "imds.json"
    state.write_text("{}")
    port = free_port()
    server = serve_in_thread(port, state)
    try:
        yield state, server, spot_watch.Imds(f"http://127.0.0.1:{port}")
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
def test_instance_action_parses_each_action(action):
    n = spot_watch.parse_instance_action(json.dumps({"action": action, "time": "2026-12-06T17:00:00Z"}))
    assert (n.kind, n.action, n.time) == ("interruption", action, "2026-12-06T17:00:00Z")
    assert n.reason == f"spot interruption: {action} at 2026-12-06T17:00:00Z"


def test_rebalance_parses_notice_time():
    n = spot_watch.parse_rebalance('{"noticeTime": "2026-12-06T16:58:00Z"}')
    assert (n.kind, n.time) == ("rebalance", "2026-12-06T16:58:00Z")


@pytest.mark.parametrize("body", ["", "not json", '{"time": "x"}', "[1]"])
def test_malformed_notice_is_an_error(body):
    with pytest.raises(spot_watch.ImdsError, match="instance-action"):
        spot_watch.parse_instance_action(body)


def test_non_http_endpoint_is_refused():
    with pytest.raises(ValueError, match="SLURM_GPU_IMDS"):
        spot_watch.Imds("https://169.254.169.254")


# ---------------------------------------------------------------- the service


def test_404_is_no_notice(imds):
    _, server, client = imds
    assert client.notices() == []
    assert server.issued == 1  # one token serves both items


def test_notices_from_the_service(imds):
    state, _, client = imds
    state.write_text(json.dumps({"instance-action": {"action": "stop", "time": "T1"},
                                 "rebalance": {"noticeTime": "T0"}}))
    assert client.notices() == [spot_watch.Notice("interruption", "stop", "T1"),
                                spot_watch.Notice("rebalance", "rebalance", "T0")]


def test_token_refreshed_when_refused(imds):
    state, server, client = imds
    client.notices()
    state.write_text(json.dumps({"revoke": True, "instance-action": {"action": "terminate", "time": "T"}}))
    assert [n.action for n in client.notices()] == ["terminate"]  # 401, a new token, the answer
    assert server.issued == client.tokens == 2


def test_token_refreshed_before_it_expires(imds):
    _, server, _client = imds
    now = [0.0]
    client = spot_watch.Imds(_client.base, clock=lambda: now[0])
    client.notices()
    client.notices()
    assert client.tokens == 1
    now[0] = spot_watch.TOKEN_TTL_S - spot_watch.TOKEN_MARGIN_S  # about to expire: a new one first
    client.notices()
    assert client.tokens == 2 and server.issued == 2


# ---------------------------------------------------------------- what it does


class FakeSlurm:
    """Records the Slurm commands; squeue lists job 42 on the node; sinfo gives `reason`."""

    def __init__(self, reason=""):
        self.calls, self.reason = [], reason

    def __call__(self, *argv):
        self.calls.append(list(argv))
        out = {"squeue": "42\n", "sinfo": self.reason + "\n"}.get(argv[0], "")
        return subprocess.CompletedProcess(argv, 0, out, "")


RANK = """
import os, signal, sys, time
got = sys.argv[-1]
for s in (signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, lambda n, f: open(got, "a").write(signal.Signals(n).name + "\\n"))
open(got + ".ready", "w").close()
while True:
    time.sleep(0.05)
"""


class Ranks:
    """Real processes standing in for this node's ranks: each records the signals it gets."""

    def __init__(self, tmp_path):
        self.tmp, self.procs = tmp_path, []

    def start(self, name, argv_tail=(), env=None) -> subprocess.Popen:
        got = self.tmp / name
        p = subprocess.Popen([sys.executable, "-c", RANK, *argv_tail, str(got)],
                             env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append(p)
        # Until its handlers are installed: a signal before that would end it (SIGUSR1's default).
        # A generous deadline, not a timing assumption: a loaded CI machine starts Python slowly.
        deadline = time.monotonic() + 60
        while not (self.tmp / f"{name}.ready").exists():
            assert p.poll() is None and time.monotonic() < deadline, f"{name} never got ready"
            time.sleep(0.02)
        return p

    def got(self, name) -> list[str]:
        """The signals a rank recorded, once it recorded one: every caller expects at least one.
        A whole line, not just the file: the handler creates the file before it writes its line."""
        path, deadline = self.tmp / name, time.monotonic() + 30
        while time.monotonic() < deadline:
            text = path.read_text() if path.exists() else ""
            if text.endswith("\n"):
                return text.split()
            time.sleep(0.02)
        return []

    def close(self):
        for p in self.procs:
            p.kill()
            p.wait()


@pytest.fixture
def ranks(tmp_path):
    r = Ranks(tmp_path)
    yield r
    r.close()


def test_interruption_drains_and_signals_each_rank_once(imds, ranks):
    state, _, client = imds
    slurm, said = FakeSlurm(), []
    rank = ranks.start("rank0")
    pids = [rank.pid]
    w = spot_watch.Watcher(client, "gpu-node-02", run=slurm, say=said.append,
                           find_pids=lambda job, node: list(pids) if (job, node) == ("42", "gpu-node-02") else [])
    assert w.poll() == []
    slurm.calls.clear()
    state.write_text(json.dumps({"instance-action": {"action": "stop", "time": "2026-12-06T17:00:00Z"},
                                 "rebalance": {"noticeTime": "2026-12-06T16:59:00Z"}}))
    assert [n.kind for n in w.poll()] == ["interruption"]  # the interruption's checkpoint covers the rebalance
    assert slurm.calls == [
        ["scontrol", "update", "nodename=gpu-node-02", "state=DRAIN",
         "reason=spot interruption: stop at 2026-12-06T17:00:00Z"],
        ["squeue", "-h", "-w", "gpu-node-02", "-t", "RUNNING", "-o", "%A"],
    ]
    assert ranks.got("rank0") == ["SIGUSR1"]
    # The notice still stands: a rank that started meanwhile (still loading) gets it; the first not again.
    late = ranks.start("rank1")
    pids.append(late.pid)
    assert w.poll() == []
    assert ranks.got("rank1") == ["SIGUSR1"] and ranks.got("rank0") == ["SIGUSR1"]
    assert not any(c[:2] == ["scontrol", "update"] for c in slurm.calls[2:])  # drained once


def test_rebalance_checkpoints_without_drain(imds, ranks):
    state, _, client = imds
    slurm, said = FakeSlurm(), []
    rank = ranks.start("rank0")
    w = spot_watch.Watcher(client, "gpu-node-01", run=slurm, say=said.append, find_pids=lambda job, node: [rank.pid])
    w.started = True
    state.write_text(json.dumps({"rebalance": {"noticeTime": "T0"}}))
    w.poll()
    w.poll()  # standing: no second checkpoint
    assert slurm.calls == [["squeue", "-h", "-w", "gpu-node-01", "-t", "RUNNING", "-o", "%A"]] * 2
    assert ranks.got("rank0") == ["SIGUSR2"]
    assert "checkpoint only, no drain" in said[0]


def test_the_ranks_are_found_by_their_module_job_and_node_never_the_agent(ranks):
    """What runs on a node under Slurm: torchrun's agent (`-m torch.distributed.run ... -m training.train`)
    and its workers (`-m training.train`, their own session); only this job's workers on this node."""
    mine = {"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "gpu-node-01"}
    worker = ranks.start("w", ("-m", "training.train"), mine)
    agent = ranks.start("a", ("-m", "torch.distributed.run", "-m", "training.train"), mine)
    other_job = ranks.start("j", ("-m", "training.train"), {**mine, "SLURM_JOB_ID": "43"})
    other_node = ranks.start("n", ("-m", "training.train"), {**mine, "SLURMD_NODENAME": "gpu-node-02"})
    not_training = ranks.start("x", ("-m", "training.other"), mine)
    found = spot_watch.training_pids("42", "gpu-node-01")
    assert worker.pid in found
    assert not {agent.pid, other_job.pid, other_node.pid, not_training.pid} & set(found)


def test_back_after_a_stop_resumes_once_slurm_answers(imds):
    """The watcher starts before slurmd, munge and /scratch: an unanswered sinfo is tried again."""
    _, _, client = imds

    class Late(FakeSlurm):
        def __call__(self, *argv):
            res = super().__call__(*argv)
            if argv[0] == "sinfo" and sum(c[0] == "sinfo" for c in self.calls) == 1:
                return subprocess.CompletedProcess(argv, 1, "", "Unable to contact slurm controller")
            return res

    slurm = Late("spot interruption: stop at T")
    w = spot_watch.Watcher(client, "gpu-node-01", run=slurm, say=lambda m: None)
    w.poll()
    assert not w.started and ["scontrol", "update", "nodename=gpu-node-01", "state=RESUME"] not in slurm.calls
    w.poll()
    assert w.started and ["scontrol", "update", "nodename=gpu-node-01", "state=RESUME"] in slurm.calls


@pytest.mark.parametrize("reason, resumed", [("spot interruption: stop at T", True), ("Not responding", False),
                                             ("", False)])
def test_start_resumes_only_its_own_drain(imds, reason, resumed):
    _, _, client = imds
    slurm = FakeSlurm(reason)
    spot_watch.Watcher(client, "gpu-node-01", run=slurm, say=lambda m: None).poll()
    assert (["scontrol", "update", "nodename=gpu-node-01", "state=RESUME"] in slurm.calls) == resumed


# ---------------------------------------------------------------- render


def _code(tree: ast.Module) -> str:
    """The module's code: its AST without docstrings (what the program does, not what it says)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def test_watcher_files_only_on_spot_gpu_nodes():
    facts = FACTS["l4x2"]
    assert not any("spot" in p for p in render.role_files(facts, "gpu"))
    assert "spot-watch" not in user_data.bootstrap_script(facts, "gpu", "gpu-node-01")
    spot = replace(facts, spot=True)
    gpu = render.role_files(spot, "gpu")
    # The watcher's code exactly, without its docstrings and comments (EC2's 16 KiB of user-data).
    source = render.Path(spot_watch.__file__).read_text()
    shipped = gpu[node_layout.SPOT_WATCH_PATH]
    assert shipped.startswith("#!/usr/bin/python3\n") and '"""' not in shipped and len(shipped) < 0.7 * len(source)
    assert _code(ast.parse(shipped)) == _code(ast.parse(source))
    assert node_layout.FILE_MODES[node_layout.SPOT_WATCH_PATH] == 0o755
    assert f"SLURM_GPU_IMDS={DEFAULT_IMDS}\n" in gpu[node_layout.SPOT_WATCH_ENV]
    unit = gpu[node_layout.SPOT_WATCH_UNIT_PATH]
    assert f"ExecStart=/usr/bin/python3 {node_layout.SPOT_WATCH_PATH}\n" in unit and "Restart=always" in unit
    assert not any("spot" in p for p in render.role_files(spot, "controller"))
    assert f"systemctl enable --now {node_layout.SPOT_WATCH_UNIT}" in user_data.bootstrap_script(spot, "gpu", "gpu-node-01")
    user_data.user_data_gzip(replace(FACTS["h100x3"], spot=True), "gpu")  # still fits EC2's 16 KiB


def test_bad_endpoint_names_the_setting():
    with pytest.raises(ValueError, match="spot_imds"):
        render.render_files(replace(FACTS["l4x2"], spot=True, spot_imds="169.254.169.254; rm -rf /"))


def test_spot_bootstrap_passes_shellcheck(tmp_path):
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed")
    p = tmp_path / "gpu.sh"
    p.write_text(user_data.bootstrap_script(replace(FACTS["single"], spot=True), "gpu", "gpu-node-01"))
    res = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", str(p)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------- training and fab


def step(callback, global_step, max_steps=100):
    args = SimpleNamespace(output_dir="/out")
    state = SimpleNamespace(global_step=global_step, max_steps=max_steps, is_world_process_zero=True)
    control = SimpleNamespace(should_save=False, should_training_stop=False)
    callback.on_step_end(args, state, control)
    return control


def test_training_checkpoints_on_the_signals(capsys):
    from training.interrupts import CheckpointOnSignal

    old = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        cb = CheckpointOnSignal()
        assert not step(cb, 3).should_save
        os.kill(os.getpid(), signal.SIGUSR2)  # rebalance: a checkpoint, training goes on
        c = step(cb, 4)
        assert c.should_save and not c.should_training_stop and cb.stopped_at is None
        assert not step(cb, 5).should_save  # once
        os.kill(os.getpid(), signal.SIGUSR1)  # interruption: checkpoint this step, then stop
        c = step(cb, 6)
        assert c.should_save and c.should_training_stop and cb.stopped_at == 6
        out = capsys.readouterr().out
        assert 'SLURM_GPU_SPOT {"kind": "rebalance", "step": 4' in out
        assert '"kind": "interruption", "step": 6, "checkpoint": "/out/checkpoint-6", "stop": true' in out
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_a_signal_before_the_trainer_exists_is_kept_for_the_first_step():
    """install() at the process's start: a notice while data and model load is not lost."""
    from training import interrupts

    old = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        for s in old:
            signal.signal(s, signal.SIG_IGN)  # as the job script's wrapper leaves it
        interrupts.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        cb = interrupts.CheckpointOnSignal()
        c = step(cb, 1)
        assert c.should_save and c.should_training_stop and cb.stopped_at == 1
    finally:
        interrupts._pending[0] = interrupts.NONE
        for s, h in old.items():
            signal.signal(s, h)


def test_fab_says_what_the_spot_line_means():
    log = JobLog()
    log.feed('SLURM_GPU_JOB {"job_id": "7", "restart": 0, "job_dir": "/j", "nodes": "gpu-node-[01-02]"}\n')
    [ev] = log.feed('0: SLURM_GPU_SPOT {"kind": "interruption", "step": 12, "checkpoint": "/o/checkpoint-12", '
                    '"stop": true}\n')
    assert ev.kind == "spot" and log.nodes == "gpu-node-[01-02]"
    from ops.finetune.joblog import spot_line

    assert spot_line(ev.data, "gpu-node-02", "stop at T") == (
        "spot interruption on gpu-node-02 (stop at T): checkpoint at step 12, requeued; the job resumes from it "
        "when enough nodes are back")
    [ev] = log.feed('0: SLURM_GPU_SPOT {"kind": "rebalance", "step": 5, "checkpoint": "c", "stop": false}\n')
    assert log.describe(ev).startswith("spot rebalance recommendation: checkpoint at step 5; training goes on")
