"""Data from a GPU node never becomes a command or a path outside its folder (issue 44, items 1-2).

What a job writes (its log, its output directory) and what the Hub answers are read as an attacker
would write them: through the real parser (ops/finetune/joblog.py), the real code that builds the
controller's commands (ops/finetune/stream.py, spot_notice.py) with a Connection that records what
it is asked to run, the real download (ops/finetune/run_home.py) over a fake SFTP listing, and the
real Hub manifest and controller-side fetch (ops/actions/prefetch.py, fetch_files.py) over loopback.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import paramiko
import pytest

from ops.actions import fetch_files, netcheck, prefetch, slurm
from ops.finetune import launch, run_home, runs, spot_notice, stream
from ops.finetune.joblog import JobLog

JOB_DIR = "/scratch/slurm-gpu/jobs/20261207-031700-abc123"
REAL_JOB = json.dumps({"job_id": "7", "restart": 0, "job_dir": JOB_DIR, "nodes": "gpu-node-[01-02]"})
SPOT_STOP = '0: SLURM_GPU_SPOT {"kind": "interruption", "step": 12, "checkpoint": "c", "stop": true}'


class RecordingConnection:
    """A Connection that records every command it is asked to run and answers nothing drained."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def run(self, cmd: str, **kw) -> SimpleNamespace:
        self.ran.append(cmd)
        return SimpleNamespace(ok=True, stdout="", stderr="")

    sudo = run


def _hostile_job(nodes: str, job_dir: str = "/home/ubuntu/.ssh", prefix: str = "") -> str:
    return prefix + "SLURM_GPU_JOB " + json.dumps({"job_id": "7", "restart": 0, "job_dir": job_dir, "nodes": nodes})


HOSTILE_NODES = [
    "gpu-node-01' -o x; touch /tmp/pwned; echo '",  # closes today's quotes
    "gpu-node-01;id",
    "$(touch /tmp/pwned)",
    "`touch /tmp/pwned`",
    "gpu-node-01\ntouch /tmp/pwned",  # a JSON "\n": a newline inside the value
    "gpu-node-01 -o %N|sh",
    "--format=x",
]


def _follow(lines: list[str]) -> tuple[JobLog, RecordingConnection, list[str]]:
    """Feed log lines as `fab train` does (stream._report with follow's spot explanation)."""
    log, ctl, said = JobLog(), RecordingConnection(), []
    data = ("\n".join(lines) + "\n").encode()
    stream._report(log, data, said.append, raw=False, explain=lambda ev: spot_notice.describe(ctl, log, ev))
    return log, ctl, said


def test_hostile_log_lines_never_reach_the_controllers_shell():
    lines = [f"SLURM_GPU_JOB {REAL_JOB}"]
    for nodes in HOSTILE_NODES:
        lines += [_hostile_job(nodes),  # a whole forged line: its values are checked
                  _hostile_job(nodes, prefix="1: some library prints "),  # a tag mid-line: not a tag
                  _hostile_job(nodes, prefix="0: [rank0]: data row: ")]
    lines.append(SPOT_STOP)
    log, ctl, said = _follow(lines)
    assert ctl.ran == ["sinfo -h -N -n 'gpu-node-[01-02]' -o '%N|%E'"]
    assert log.nodes == "gpu-node-[01-02]" and log.job_dir == JOB_DIR
    assert said[-1].startswith("spot interruption: checkpoint at step 12")


def test_without_a_valid_node_list_nothing_is_asked():
    log, ctl, _ = _follow([_hostile_job(n) for n in HOSTILE_NODES] + [SPOT_STOP])
    assert ctl.ran == [] and log.nodes is None and log.job_dir is None
    for nodes in HOSTILE_NODES:  # and called directly, the command builder refuses the same values
        assert spot_notice.drained(ctl, nodes) == []
    assert ctl.ran == []


def test_tags_count_at_the_start_of_a_line_after_the_known_prefixes():
    for prefix in ("", "0: ", "  3: ", "0: [rank0]: ", "1: [default1]:"):
        log = JobLog()
        [ev] = log.feed(f"{prefix}SLURM_GPU_JOB {REAL_JOB}\n")
        assert ev.kind == "start" and log.nodes == "gpu-node-[01-02]", prefix
    for line in (f"0: echo SLURM_GPU_JOB {REAL_JOB}", f"x SLURM_GPU_JOB {REAL_JOB}",
                 "0: {'text': 'SLURM_GPU_LOG {\"step\": 1, \"loss\": 0.1}'}"):
        log = JobLog()
        assert log.feed(line + "\n") == [] and log.nodes is None and log.steps == [], line


@pytest.mark.parametrize("nodes", ["gpu-node-01", "gpu-node-[01-02]", "gpu-node-[01-03,07],controller",
                                   "ip-10-0-1-12.ec2.internal", "n[1-2]x[3]"])
def test_real_hostlists_pass(nodes):
    assert slurm.hostlist(nodes) == nodes


@pytest.mark.parametrize("nodes", [*HOSTILE_NODES, "", "a,,b", "[1-2]", "a[1-]", "a b", None, 12, ["a"]])
def test_anything_else_is_no_hostlist(nodes):
    assert slurm.hostlist(nodes) is None


# ------------------------------------------------------------------ run downloads (SFTP listing)


def _attr(name: str, mode: int) -> paramiko.SFTPAttributes:
    a = paramiko.SFTPAttributes()
    a.filename, a.st_mode = name, mode
    return a


class FakeSFTP:
    """An SFTP listing as a compromised controller could answer it. A listed file serves "from PATH";
    `now` holds what a path is when lstat'ed or opened (after the listing), as (mode, size, bytes served)."""

    def __init__(self, listing: dict[str, list[paramiko.SFTPAttributes]],
                 now: dict[str, tuple[int, int, bytes]] | None = None) -> None:
        self.listing, self.now, self.read = listing, now or {}, 0

    def listdir_attr(self, path: str) -> list[paramiko.SFTPAttributes]:
        return self.listing[path]

    def _now(self, path: str) -> tuple[int, int, bytes]:
        body = f"from {path}".encode()
        return self.now.get(path, (REG, len(body), body))

    def lstat(self, path: str) -> paramiko.SFTPAttributes:
        a = paramiko.SFTPAttributes()
        a.st_mode, a.st_size, _ = self._now(path)
        return a

    def open(self, path: str, mode: str = "r"):
        sftp = self
        (fmode, fsize, body), at = self._now(path), [0]

        class Handle(io.RawIOBase):
            def stat(self):
                a = paramiko.SFTPAttributes()
                a.st_mode, a.st_size = fmode, fsize
                return a

            def read(self, n=-1):  # a body of b"\0" stands for an endless device (/dev/zero)
                chunk = b"\0" * n if body == b"\0" else body[at[0]:at[0] + n]
                at[0] += len(chunk)
                sftp.read += len(chunk)
                return chunk

        return Handle()


REG, DIR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755


def test_a_hostile_listing_writes_nothing_outside_the_run_folder(tmp_path, capsys):
    out = f"{JOB_DIR}/output"
    hostile = ["../../escaped", "/" + str(tmp_path / "absolute"), "sub/escaped", "..", ".", "a\\b", "a\x00b", ""]
    sftp = FakeSFTP({out: [_attr("adapter_model.safetensors", REG), _attr("metrics.json", REG),
                           _attr("tensorboard", DIR), *(_attr(n, REG) for n in hostile)],
                     f"{out}/tensorboard": [_attr("events.1", REG), _attr("../../../escaped-tb", REG)]})
    dest = tmp_path / "runs" / "7"
    dest.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("mine")
    (dest / "metrics.json.part").symlink_to(victim)  # planted beside: a symbolic link pointing out
    got = run_home.download(SimpleNamespace(sftp=lambda: sftp), out, dest)  # says refusals with print
    said = capsys.readouterr().out.splitlines()
    assert got == ["adapter_model.safetensors", "tensorboard/"]
    assert victim.read_text() == "mine"
    inside = {p for p in tmp_path.rglob("*")}
    assert inside == {tmp_path / "runs", dest, victim, dest / "metrics.json.part", dest / "adapter_model.safetensors",
                      dest / "tensorboard", dest / "tensorboard" / "events.1"}, sorted(map(str, inside))
    for name in [*hostile, "metrics.json.part", "../../../escaped-tb"]:
        assert any(repr(name) in s for s in said), (name, said)


def test_a_download_never_writes_over_fabs_own_records(tmp_path, capsys):
    out = f"{JOB_DIR}/output"
    own = sorted(run_home.OWN_RECORDS)
    sftp = FakeSFTP({out: [_attr("adapter_model.safetensors", REG), *(_attr(n, REG) for n in own),
                           _attr("tensorboard", DIR)],
                     f"{out}/tensorboard": [_attr("events.1", REG), _attr("gpus", REG)]})
    dest = tmp_path / "runs" / "7"
    dest.mkdir(parents=True)
    (dest / "job_dir").write_text(JOB_DIR + "\n")  # fab's record, written before the download
    got = run_home.download(SimpleNamespace(sftp=lambda: sftp), out, dest)
    said = capsys.readouterr().out
    assert got == ["adapter_model.safetensors", "tensorboard/"]
    assert (dest / "job_dir").read_text() == JOB_DIR + "\n"
    assert sorted(p.name for p in dest.iterdir()) == ["adapter_model.safetensors", "job_dir", "tensorboard"]
    assert [p.name for p in (dest / "tensorboard").iterdir()] == ["events.1"]  # gpus/ is fab's (gpu_events)
    assert "'gpus' is the name of fab's own record" in said
    for name in ["run.json", "network.json", "job.log", "job_dir", "timeline.json"]:
        assert f"{name!r} is the name of fab's own record" in said, (name, said)


def test_a_download_stops_at_its_size_caps(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_home, "MAX_FILE_BYTES", 1000)
    monkeypatch.setattr(run_home, "MAX_RUN_BYTES", 1500)
    out = f"{JOB_DIR}/output"
    names = ["a_huge", "b_grows", "c_ok", "d_ok", "e_over_total"]
    sftp = FakeSFTP({out: [_attr(n, REG) for n in names]},
                    now={f"{out}/a_huge": (REG, 2**40, b"\0"),  # a 1 TB (sparse) file
                         f"{out}/b_grows": (REG, 10, b"x" * 5000),  # small when stat'ed, grows while read
                         f"{out}/c_ok": (REG, 800, b"c" * 800),
                         f"{out}/d_ok": (REG, 600, b"d" * 600),
                         f"{out}/e_over_total": (REG, 200, b"e" * 200)})
    dest = tmp_path / "run"
    got = run_home.download(SimpleNamespace(sftp=lambda: sftp), out, dest)
    said = capsys.readouterr().out
    assert got == ["c_ok", "d_ok"]
    assert sorted(p.name for p in dest.iterdir()) == ["c_ok", "d_ok"]  # no left-over .part
    assert sftp.read <= 800 + 600 + 1001 + 100, sftp.read  # what was read stops at the caps
    assert "'a_huge': 1024.0 GiB, over the cap" in said
    assert "'b_grows': grew past the cap" in said
    assert "'e_over_total'" in said and "over the cap" in said.split("'e_over_total'")[1]


def test_a_file_swapped_for_a_link_after_the_listing_is_not_followed(tmp_path, capsys):
    out = f"{JOB_DIR}/output"
    sftp = FakeSFTP({out: [_attr("adapter_model.safetensors", REG), _attr("metrics.json", REG),
                           _attr("samples.md", REG)]},
                    now={f"{out}/metrics.json": (stat.S_IFLNK | 0o777, 9, b"\0"),  # lstat: now a link
                         # lstat said a file, open (which follows links) reaches a device: /dev/zero
                         f"{out}/samples.md": (stat.S_IFCHR | 0o666, 0, b"\0")})
    real_lstat = sftp.lstat
    sftp.lstat = lambda p: real_lstat(p) if not p.endswith("samples.md") else _attr("samples.md", REG)
    got = run_home.download(SimpleNamespace(sftp=lambda: sftp), out, tmp_path / "run")
    said = capsys.readouterr().out
    assert got == ["adapter_model.safetensors"]
    assert sftp.read == len(f"from {out}/adapter_model.safetensors")
    assert "'metrics.json': no longer a regular file" in said
    assert "'samples.md': not a regular file when opened" in said


# ------------------------------------------------------------------ the Hub prefetch


class HubAPI(http.server.BaseHTTPRequestHandler):
    """The revision API's answer (https://huggingface.co/docs/hub/api), with names chosen by a test."""

    answer: dict = {}

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps(HubAPI.answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HubAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


SHA = "0123456789abcdef0123456789abcdef01234567"


def _sibling(name: str) -> dict:
    return {"rfilename": name, "size": 3, "lfs": {"sha256": "0" * 64}}


@pytest.mark.parametrize("name", ["../../../../tmp/x", "/etc/cron.d/x", "a/../../x", "a//b", "./x", "a\\..\\x",
                                  "x\n"])
def test_a_hostile_hub_file_name_is_refused_naming_it(hub, name, tmp_path):
    HubAPI.answer = {"sha": SHA, "siblings": [_sibling("config.json"), _sibling(name)]}
    with pytest.raises(prefetch.PrefetchError) as err:
        prefetch.hub_manifest("org/m", str(tmp_path / "hub"), endpoint=hub)
    assert repr(name) in str(err.value) and "nothing is fetched" in str(err.value)


@pytest.mark.parametrize("sha", ["../../../../tmp", "main/../..", "abc123", "x" * 40, 7])
def test_a_hostile_hub_commit_is_refused(hub, sha, tmp_path):
    HubAPI.answer = {"sha": sha, "siblings": [_sibling("config.json")]}
    with pytest.raises(prefetch.PrefetchError, match="not a commit id"):
        prefetch.hub_manifest("org/m", str(tmp_path / "hub"), endpoint=hub)


@pytest.mark.parametrize("answer,named", [
    ({"sha": SHA, "siblings": [{"rfilename": "a", "size": 1e400}]}, "size inf"),  # JSON's 1e400: float inf
    ({"sha": SHA, "siblings": [{"rfilename": "a", "size": "zz"}]}, "size 'zz'"),
    ({"sha": SHA, "siblings": [{"rfilename": "a", "size": -5}]}, "size -5"),
    ({"sha": SHA, "siblings": [{"rfilename": "a", "size": 2.5}]}, "size 2.5"),
    ({"sha": SHA, "siblings": [{"rfilename": "a", "size": True}]}, "size True"),
    ({"sha": SHA, "siblings": [{"rfilename": "a", "size": 1, "lfs": "x"}]}, "lfs 'x'"),
    ({"sha": SHA, "siblings": [{"rfilename": "a", "size": 1, "lfs": {"sha256": 7}}]}, "lfs {'sha256': 7}"),
    ({"sha": SHA, "siblings": [{"rfilename": "a", "size": 1, "lfs": {"sha256": "../x"}}]}, "lfs {'sha256': '../x'}"),
    ([1, 2], "is a list"), ("x", "is a str"),
])
def test_a_malformed_hub_answer_is_a_prefetch_error_naming_the_value(hub, answer, named, tmp_path):
    HubAPI.answer = answer
    with pytest.raises(prefetch.PrefetchError) as err:
        prefetch.hub_manifest("org/m", str(tmp_path / "hub"), endpoint=hub)
    assert named in str(err.value) and "nothing is fetched" in str(err.value)


def test_a_real_hub_answer_still_makes_its_manifest(hub, tmp_path):
    HubAPI.answer = {"sha": SHA, "siblings": [_sibling("config.json"), _sibling("data/train-0.parquet")]}
    m = prefetch.hub_manifest("org/m", str(tmp_path / "hub"), endpoint=hub)
    assert m["dest"] == f"{tmp_path}/hub/models/org/m@{SHA}"
    assert [f["path"] for f in m["files"]] == ["config.json", "data/train-0.parquet"]


def _fetch(manifest: dict) -> subprocess.CompletedProcess:
    """The controller's side as it runs there: the program alone, the manifest on stdin."""
    return subprocess.run([sys.executable, str(prefetch.SCRIPT)], input=json.dumps(manifest), capture_output=True,
                          text=True, timeout=60, cwd="/")


def _files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if not p.is_dir() or p.is_symlink()}


def test_the_controller_side_refuses_a_name_leaving_dest_before_writing_anything(tmp_path):
    src = tmp_path / "src" / "repo"
    src.mkdir(parents=True)
    (src / "ok.json").write_bytes(b"abc")
    (tmp_path / "src" / "evil").write_bytes(b"abc")  # what "../evil" reads from the source
    dest = tmp_path / "out" / "dest"
    manifest = {"source": str(src), "dest": str(dest),
                "files": [{"path": "ok.json", "size": 3}, {"path": "../evil", "size": 3}]}
    res = _fetch(manifest)
    assert res.returncode == 1 and "fetch error: '../evil'" in res.stderr, res.stderr
    assert _files_under(tmp_path / "out") == set()


@pytest.mark.parametrize("plant", ["file", "folder"])
def test_the_controller_side_never_writes_through_a_symlink(tmp_path, plant):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "w.bin").write_bytes(b"abc")
    dest = tmp_path / "dest"
    (dest / "sub").mkdir(parents=True) if plant == "file" else dest.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    if plant == "file":  # a job planted the half-done file as a link to something of the admin's
        (victim / "authorized_keys").write_text("mine")
        (dest / "sub" / "w.bin.partial").symlink_to(victim / "authorized_keys")
    else:
        (dest / "sub").symlink_to(victim)
    res = _fetch({"source": str(src), "dest": str(dest), "files": [{"path": "sub/w.bin", "size": 3}]})
    assert res.returncode == 1 and "fetch error: 'sub/w.bin" in res.stderr and "symbolic link" in res.stderr, \
        res.stderr
    assert [p.name for p in victim.iterdir()] == (["authorized_keys"] if plant == "file" else [])
    assert plant == "folder" or (victim / "authorized_keys").read_text() == "mine"


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "/a", "a\\b", "a\x00b", "a\nb", None])
def test_one_check_refuses_a_single_name_that_leaves_its_folder(name):
    with pytest.raises(fetch_files.UnsafeName) as err:
        fetch_files.safe_name(name)
    assert repr(name) in str(err.value)


def test_nested_names_from_the_hub_pass():
    for name in ("config.json", "data/train-00000-of-00002.parquet", "onnx/model.onnx", ".gitattributes"):
        assert fetch_files.safe_name(name, nested=True) == name


def test_the_training_archive_refuses_a_link_and_holds_plain_names_under_training(tmp_path, monkeypatch):
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(launch.training_tarball())) as tar:
        members = tar.getmembers()
    assert members and all(m.isreg() or m.isdir() for m in members)
    assert all(m.name == "training" or m.name.startswith("training/") for m in members)
    planted = tmp_path / "training"
    planted.mkdir()
    (planted / "train.py").write_text("")
    (planted / "keys").symlink_to("/root/.ssh")
    monkeypatch.setattr(launch, "TRAINING_DIR", planted)
    with pytest.raises(launch.TrainError, match="training/keys is not a regular file or folder"):
        launch.training_tarball()


def test_fab_logs_downloads_only_from_a_job_dir_of_ours():
    assert os.path.basename(JOB_DIR)  # the shape launch.new_job_dir makes
    inv = SimpleNamespace(scratch="/scratch")
    made = launch.new_job_dir(inv)
    log = JobLog()
    log.feed("SLURM_GPU_JOB " + json.dumps({"job_id": "7", "restart": 0, "job_dir": made, "nodes": "n1"}) + "\n")
    assert log.job_dir == made
    for bad in ("/home/ubuntu/.ssh", "/scratch/slurm-gpu/jobs/../../etc", "/scratch/slurm-gpu/jobs/x; id",
                "relative/slurm-gpu/jobs/20261207-031700-abc123", "/a/../slurm-gpu/jobs/20261207-031700-abc123"):
        log.feed("SLURM_GPU_JOB " + json.dumps({"job_id": "7", "restart": 0, "job_dir": bad}) + "\n")
        assert log.job_dir == made, bad


def _source_and_victim(tmp_path):
    """A fetch source holding config.json (3 bytes), and an empty folder a planted link points to."""
    src, victim = tmp_path / "src", tmp_path / "victim"
    src.mkdir()
    (src / "config.json").write_bytes(b"abc")
    victim.mkdir()
    return src, victim


def test_the_controller_side_never_follows_a_link_planted_between_the_fetch_area_and_dest(tmp_path):
    """/scratch is shared with the jobs: a folder on the way to dest may be a link a job planted."""
    src, victim = _source_and_victim(tmp_path)
    (tmp_path / "hub" / "models").mkdir(parents=True)
    (tmp_path / "hub" / "models" / "org").symlink_to(victim)
    manifest = {"source": str(src), "dest": f"{tmp_path}/hub/models/org/m@{SHA}", "root": f"{tmp_path}/hub",
                "files": [{"path": "config.json", "size": 3}]}  # what hub_manifest makes
    res = _fetch(manifest)
    assert res.returncode == 1 and "symbolic link" in res.stderr and f"org/m@{SHA}" in res.stderr, res.stderr
    assert list(victim.iterdir()) == []
    assert prefetch.manifest_of_dir(str(src), manifest["dest"], {"config.json": 3}, root=manifest["root"]) == manifest


def test_the_controller_side_never_follows_a_link_planted_at_the_fetch_areas_root(tmp_path):
    """/scratch/hub belongs to the admin user: a job can replace it with a link to a folder of its choice."""
    src, victim = _source_and_victim(tmp_path)
    (tmp_path / "hub").symlink_to(victim)
    res = _fetch({"source": str(src), "dest": f"{tmp_path}/hub/models/org/m@{SHA}", "root": f"{tmp_path}/hub",
                  "files": [{"path": "config.json", "size": 3}]})
    assert res.returncode == 1 and "hub on its way is a symbolic link" in res.stderr, res.stderr
    assert list(victim.iterdir()) == []


def test_tagged_lines_of_the_wrong_shape_are_text_and_never_stop_fab(capsys):
    """A forged line with values of the wrong type (or a nesting bomb) is dropped; what was known stays."""
    lines = [f"SLURM_GPU_JOB {REAL_JOB}",
             'SLURM_GPU_JOB {"restart": "x", "nodes": "evil[1]", "job_dir": "/x"}',
             '0: SLURM_GPU_RESUMED {"step": "x"}',
             '0: SLURM_GPU_RESUMED {"step": [1]}',
             '0: SLURM_GPU_LOG {"step": "x", "loss": 1.0}',
             '0: SLURM_GPU_LOG {"step": 1, "max_steps": 1e999, "loss": 1.0}',
             '0: SLURM_GPU_LOG {"step": 1, "loss": "high"}',
             "0: {'loss': " + "[" * 5000 + "]" * 5000 + "}",
             "SLURM_GPU_JOB {" + '"a":' * 1 + "[" * 100000 + "]" * 100000 + "}",
             '0: SLURM_GPU_LOG {"step": 2, "max_steps": 5, "loss": 2.0}']
    log, ctl, said = _follow(lines)
    assert log.nodes == "gpu-node-[01-02]" and log.job_dir == JOB_DIR and log.restarts == 0
    assert log.resumed_from is None and [s["step"] for s in log.steps] == [2]
    assert said == ["job started on gpu-node-[01-02]", "step 2/5  loss 2.0000"], said


def test_the_controller_side_is_not_hung_by_a_planted_fifo(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"abc")
    dest = tmp_path / "dest"
    dest.mkdir()
    os.mkfifo(dest / "w.bin.partial")
    res = _fetch({"source": str(src), "dest": str(dest), "files": [{"path": "w.bin", "size": 3}]})
    assert res.returncode == 1 and "fetch error: 'w.bin': w.bin.partial is not a plain file" in res.stderr, res.stderr


def _scontrol_line(name: str, state: str = "RUNNING", restarts: str = "0") -> str:
    """`scontrol show job -o` as Slurm prints it (src/api/job_info.c's order: JobId, JobName, UserId, ...)."""
    return (f"JobId=42 JobName={name} UserId=ubuntu(1000) GroupId=ubuntu(1000) MCS_label=N/A Priority=1 Nice=0 "
            f"Account=(null) QOS=normal JobState={state} Reason=None Dependency=(null) Requeue=1 "
            f"Restarts={restarts} BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:05 NodeList=gpu-node-[01-02] "
            "Comment=x StdOut=/scratch/logs/slurm-gpu-finetune-42.out")


@pytest.mark.parametrize("name", ["slurm-gpu-finetune JobState=COMPLETED ExitCode=0:0",
                                  "slurm-gpu-finetune Restarts=x NodeList=evil",
                                  "JobState=COMPLETED", "a=b c"])
def test_a_job_name_cannot_add_keys_to_the_job_slurm_reports(name):
    job = slurm.job_from_fields(slurm.parse_scontrol_job(_scontrol_line(name)))
    assert (job.name, job.state, job.restarts, job.nodes) == (name, "RUNNING", 0, "gpu-node-[01-02]")
    assert not job.finished


def test_a_job_name_imitating_the_user_field_is_refused_not_misread():
    line = _scontrol_line("slurm-gpu-finetune UserId=ubuntu(1000) JobState=COMPLETED ExitCode=0:0")
    with pytest.raises(slurm.SlurmError, match="holds UserId= twice.*rename it"):
        slurm.parse_scontrol_job(line)
    ctl = RecordingConnection()
    ctl.run = lambda cmd, **kw: SimpleNamespace(ok=True, stdout=line + "\n" + _scontrol_line("ours") + "\n")
    assert [j.name for j in slurm.jobs_named(ctl, "")] == ["ours"]  # not taken for a job of ours


@pytest.mark.parametrize("restarts", ["x", "-1", "٣", "1_0", "9" * 5000])
def test_a_bad_restart_count_is_a_clear_error_not_a_traceback(restarts):
    with pytest.raises(slurm.SlurmError, match="Restarts=.*not a count"):
        slurm.job_from_fields(slurm.parse_scontrol_job(_scontrol_line("n", restarts=restarts)))


JOB_NODES = slurm.hostnames("gpu-node-[01-03]")  # the check job's NodeList, as Slurm gave it to fab
RESULT = "/scratch/slurm-gpu/netcheck/x/result.json"


def _sweep(bw):
    return [{"bytes": 4096, "time_us": 500.0, "busbw_gbps": bw / 100}, {"bytes": 4 << 20, "time_us": 9.0e3,
                                                                         "busbw_gbps": bw}]


def _netcheck_result(**change) -> dict:
    a, b = JOB_NODES[:2]
    res = {"nodes": [a, b], "all": _sweep(9.0), "seconds": 2.5, "backend": "gloo",
           "pairs": [{"nodes": [a, b], "results": _sweep(9.0)}],
           "node_info": {n: {"host": n, "transport": "gloo over eth0"} for n in (a, b)}}
    return {**res, **change}


@pytest.mark.parametrize("change", [
    {"nodes": ["gpu-[1-64]", "ALL"]},  # the reviewer's probe: one drain for every node
    {"nodes": ["gpu-node-01", "gpu-node-09"]},  # a real-looking name outside the job
    {"nodes": ["gpu-node-01", "gpu-node-01"]}, {"nodes": "gpu-node-01"}, {"nodes": [1, 2]}, {"nodes": []},
    {"pairs": [{"nodes": ["gpu-node-01", "gpu-[1-64]"], "results": _sweep(1.0)}]},
    {"pairs": [{"nodes": ["gpu-node-01", "gpu-node-02"], "results": []}]},  # was a ValueError in max()
    {"pairs": [{"nodes": ["gpu-node-01", "gpu-node-02"],
                "results": [{"bytes": 1, "busbw_gbps": "x", "time_us": 1}]}]},  # was a TypeError
    {"pairs": [{"nodes": ["gpu-node-01", "gpu-node-02"],
                "results": [{"bytes": 1, "busbw_gbps": float("nan"), "time_us": 1}]}]},
    {"pairs": "x"}, {"pairs": [7]}, {"all": [{"bytes": True}]}, {"seconds": "x"},
    {"node_info": {"gpu-[1-64]": {"transport": "x"}}}, {"node_info": {"gpu-node-01": {"transport": 3}}},
])
def test_a_result_file_a_job_wrote_is_refused_naming_it_and_nothing_is_drained(change):
    with pytest.raises(netcheck.NetCheckError) as err:
        netcheck.checked_result(_netcheck_result(**change), JOB_NODES, RESULT)
    assert str(err.value).startswith(f"{RESULT}: ") and "\n" not in str(err.value)
    assert "Run `fab check` again" in str(err.value)


def test_a_real_result_is_judged_and_only_its_single_failed_names_are_drained():
    exp = netcheck.Expected(10.0, "gloo over eth0", 0.5, "test")
    res = netcheck.checked_result(_netcheck_result(), JOB_NODES, RESULT)
    res["node_info"]["gpu-node-02"]["transport"] = "sockets"
    v = netcheck.judge(res, exp, netcheck.transports_of(res, "", backend_nccl=False))
    ctl = RecordingConnection()
    ctl.user = "root"
    assert netcheck.drain(ctl, v.failed) == ["gpu-node-02"]
    assert len(ctl.ran) == 1 and ctl.ran[0].startswith("scontrol update nodename=gpu-node-02 state=drain")
    for odd in ("gpu-[1-64]", "a,b", "ALL x", "'a'"):
        with pytest.raises(netcheck.NetCheckError, match="not a single node name"):
            netcheck.drain(ctl, {odd: "slow"})
    assert len(ctl.ran) == 1


def test_slurms_hostlist_expands_to_single_names_and_bounds_the_count():
    assert slurm.hostnames("gpu-node-[01-02,7],ctl,a[1-2]b") == ["gpu-node-01", "gpu-node-02", "gpu-node-7", "ctl",
                                                                 "a1b", "a2b"]
    for bad in ("gpu-[1-99999999]", "a[1-99]b[1-99]", "x;y", "gpu-[1-64]'"):
        with pytest.raises(slurm.SlurmError):
            slurm.hostnames(bad)


HOSTILE_RECORDS = [  # the reviewer's probes (4 of 5 were tracebacks in `fab runs --job`), and more
    ({"metrics.json": {"samples": [{"prompt": 1}], "eval": {"tuned": {"loss": 1.0}}}}, "metrics.json samples[0]"),
    ({"metrics.json": {"samples": [{"prompt": "p"}], "eval": {"tuned": {"loss": 1.0}}}}, "samples[0] has no base"),
    ({"metrics.json": {"log_history": [{"loss": "x"}]}}, "log_history[0]: loss must be a finite number"),
    ({"metrics.json": {}, "trainer_state.json": [1, 2]}, "trainer_state.json must be a JSON object"),
    ({"metrics.json": {}, "trainer_state.json": {"log_history": [{"loss": 1.0, "step": "7"}]}}, "step must be"),
    ({"metrics.json": {}, "trainer_state.json": {"global_step": 1e400}}, "global_step must be a count"),
    ({"metrics.json": {"cost": "abc"}}, "cost must be an object"),
    ({"metrics.json": {"cost": {"max_usd": "1"}}}, "cost: max_usd must be a finite number"),
    ({"metrics.json": {"train_steps": "\x1b]52;c;ZWNobyBoaQ==\x07"}}, "train_steps must be a count"),
    ({"metrics.json": {"train_runtime": float("nan")}}, "train_runtime must be a finite number"),
    ({"metrics.json": {"eval": {"tuned": {"loss": float("inf")}}}}, "eval tuned: loss must be a finite number"),
    ({"metrics.json": {"eval": {"tuned": "x"}}}, "tuned must be"),
]


@pytest.mark.parametrize("files,named", HOSTILE_RECORDS)
def test_fab_runs_job_names_a_malformed_record_in_one_line(tmp_path, files, named):

    d = tmp_path / "12"
    d.mkdir()
    for name, value in files.items():
        (d / name).write_text(json.dumps(value))
    with pytest.raises(runs.RunsError) as err:
        runs.show(tmp_path, "12")
    assert named in str(err.value) and str(d) in str(err.value) and "\n" not in str(err.value)
    assert "\x1b" not in str(err.value)  # repr: the escape is shown, not sent to the terminal


def test_fab_trains_finish_summarises_a_run_whose_metrics_line_is_malformed(tmp_path, monkeypatch):
    from tests.unit.test_jobs_render import inventory

    monkeypatch.setattr(runs, "RUNS", tmp_path)
    log = JobLog()
    log.feed('SLURM_GPU_METRICS {"cost": "abc", "train_steps": "x"}\n')  # was AttributeError in the summary
    said: list[str] = []
    cl = SimpleNamespace(controller=None, inventory=inventory(target="local", gpus=1))
    with pytest.raises(launch.TrainError, match="holds no adapters"):  # the usual end of a run without output
        run_home.finish(cl, "12", stream.Followed(None, log), said.append)
    assert any("warning: the job log's SLURM_GPU_METRICS line: train_steps must be a count" in s for s in said)
    assert any(s.startswith("job 12: completed") for s in said)  # the summary is printed all the same
