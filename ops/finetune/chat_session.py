"""`fab chat`: talk to a run's tuned adapters on one GPU node, the answers streamed token by token.

The run is one brought home under runs/ (`fab runs` lists them; the newest by default). Its adapters are read
where the job wrote them, `<job dir>/output` on the cluster's shared storage (runs/<job>/job_dir names the job
dir), on the base model they were trained on (adapter_config.json's base_model_name_or_path: the path on the
cluster the job loaded). Everything that can be checked on this machine is checked before any host is touched
(`parse`): the run, its adapters, the prompts.

Then the chat server (training/talk.py) runs as one Slurm step (`srun`, one task, one GPU, one node) from a
fresh folder of this checkout's training/ code, as the jobs' user, its stdin and stdout piped over this SSH
session: prompts go in as JSON lines (training/talk_protocol.py), never on a command line; tokens come back
as they are generated. The model stays loaded for every prompt of the session (interactive, or every line of
--prompts-file), so only the first prompt waits for the load. Each answer ends with its time to first token
and tokens/s.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cluster import targets
from cluster.errors import UserError
from ops.actions import slurm
from ops.actions.options import ClusterOptions, OptionError, number
from ops.finetune import launch, runs
from ops.finetune.sbatch import OUTPUT
from ops.say import Say, shown
from ops.ssh.remote import Cluster, connect, exists, sudo, user_command
from training.talk import FORMATS
from training.talk_protocol import MAX_PROMPT_CHARS, ProtocolError, parse_event, prompt_line

CHAT_NAME = "slurm-gpu-chat"
DEFAULT_MAX_NEW_TOKENS = 256
MAX_PROMPTS = 10_000
# The job dir a run names (runs/<job>/job_dir, written by fab from its own launch: launch.new_job_dir): an
# absolute path of plain name characters, no "..": it reaches a command (quoted) and names what is read.
_JOB_DIR = re.compile(r"/(?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]+")
READY_TIMEOUT_S = 1800  # a node that powers up (AWS: minutes) and a model that loads
MAX_LINE_BYTES = 1 << 20  # one protocol line (a token, a done record) is far smaller


class ChatError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class ChatOptions:
    where: ClusterOptions
    run: str  # runs/<run>/
    output_dir: str  # on the cluster: the job's output_dir, its adapters
    base: str  # on the cluster: the base model they were trained on
    format: str  # the run's data format (how a prompt is shaped)
    prompts: tuple[str, ...] | None  # None: interactive
    max_new_tokens: int


def _run_dir(runs_root: Path, run: str | None) -> Path:
    """runs/<run>/, or the newest run with adapters."""
    return runs.with_adapters(runs_root, run, OptionError, "fab chat --run N")


def _prompts(prompt: str | None, prompts_file: str | None) -> tuple[str, ...] | None:
    """--prompt (one), --prompts-file (one prompt a line, blank lines skipped), or None (interactive)."""
    if prompt is not None and prompts_file is not None:
        raise OptionError("--prompt and --prompts-file both give the prompts: pass one of them")
    if prompt is not None:
        if not str(prompt).strip():
            raise OptionError("--prompt is empty: give the text to answer, e.g. --prompt 'What is LoRA?'")
        found = [str(prompt)]
    elif prompts_file is not None:
        path = Path(prompts_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise OptionError(f"--prompts-file {prompts_file}: no such file; give a text file, one prompt a line") \
                from None
        except UnicodeDecodeError:
            raise OptionError(f"--prompts-file {prompts_file} is not UTF-8 text: give a text file, one prompt a line") \
                from None
        except OSError as exc:
            raise OptionError(f"--prompts-file {prompts_file} cannot be read ({exc.strerror})") from None
        found = [line for line in text.splitlines() if line.strip()]
        if not found:
            raise OptionError(f"--prompts-file {prompts_file} holds no prompt: write one prompt a line")
        if len(found) > MAX_PROMPTS:
            raise OptionError(f"--prompts-file {prompts_file} holds {len(found)} prompts, over {MAX_PROMPTS}: split it")
    else:
        return None
    for i, p in enumerate(found, start=1):
        if len(p) > MAX_PROMPT_CHARS:
            raise OptionError(f"prompt {i} is {len(p)} characters, over {MAX_PROMPT_CHARS}: shorten it")
    return tuple(found)


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise OptionError(f"{path} cannot be read as JSON ({exc}): fix or delete that file") from None
    if not isinstance(data, dict):
        raise OptionError(f"{path} is not a JSON object: fix or delete that file")
    return data


def run_format(metrics: dict) -> str:
    """The run's data format (metrics.json choices.data_format), Alpaca for a run from before it was recorded."""
    value = ((metrics.get("choices") or {}).get("data_format") or {}).get("value") \
        if isinstance(metrics.get("choices"), dict) else None
    return value if value in FORMATS else "alpaca"


def parse(where: ClusterOptions, run=None, prompt=None, prompts_file=None, max_new_tokens=None,
          runs_root: Path | None = None) -> ChatOptions:
    """`fab chat`'s flags and the run they name, checked on this machine before any host is touched."""
    prompts = _prompts(prompt, prompts_file)
    n = DEFAULT_MAX_NEW_TOKENS if max_new_tokens in (None, "") else number("max-new-tokens", max_new_tokens, int)
    if not 1 <= n <= 32768:
        raise OptionError(f"--max-new-tokens must be 1 to 32768, not {n}")
    d = _run_dir(runs_root or runs.RUNS, run)
    if not (d / "adapter_config.json").is_file() or not any(d.glob("adapter_model.*")):
        raise OptionError(f"run {d.name} has no adapters in {d} (adapter_config.json, adapter_model.*): it did not "
                          "finish; pick another with --run (`fab runs` lists them)")
    record = _json(d / "run.json")
    target = targets.get(where.target).name
    if record.get("target") and record["target"] != target:
        raise OptionError(f"run {d.name} was trained on the {record['target']} cluster, not the {target} one: "
                          f"pass --target {record['target']}")
    job_dir = (d / "job_dir").read_text().strip() if (d / "job_dir").is_file() else ""
    if not _JOB_DIR.fullmatch(job_dir) or ".." in job_dir.split("/"):
        raise OptionError(f"run {d.name} does not name its job folder on the cluster ({d / 'job_dir'}): "
                          "it came home from elsewhere; pick a run of this cluster with --run")
    base = _json(d / "adapter_config.json").get("base_model_name_or_path")
    # A path the job loaded (quoted where it reaches a command): absolute, no "..", no control character.
    if not isinstance(base, str) or not base.startswith("/") or ".." in base.split("/") or shown(base) != base:
        raise OptionError(f"run {d.name}: adapter_config.json names the base model {base!r}, not a path on the "
                          "cluster: retrain it with `fab train`, which loads the base model from the cluster")
    return ChatOptions(where=where, run=d.name, output_dir=posixpath.join(job_dir, OUTPUT), base=base,
                       format=run_format(_json(d / "metrics.json")), prompts=prompts, max_new_tokens=n)


def server_command(opts: ChatOptions, inv, chat_dir: str, name: str) -> str:
    """The srun line that starts training/talk.py on one node (every value quoted; no prompt in it)."""
    q = shlex.quote
    env = "HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false" + \
        ("" if targets.of(inv).real_gpus else " OMP_NUM_THREADS=1")
    return (f"srun --nodes=1 --ntasks=1 --gres=gpu:1 --unbuffered --quiet --job-name={q(name)} "
            f"--chdir={q(chat_dir)} env {env} HF_HOME={q(inv.scratch + '/hf-cache')} {q(inv.python)} -u "
            f"-m training.talk --base {q(opts.base)} --adapters {q(opts.output_dir)} --format {q(opts.format)} "
            f"--max-new-tokens {opts.max_new_tokens}")


class Session:
    """The server's stdin and stdout over one SSH channel: prompts in, events out."""

    def __init__(self, channel) -> None:
        self.channel, self.buffer, self.err = channel, b"", b""

    def send(self, prompt: str) -> None:
        self.channel.sendall(prompt_line(prompt).encode())

    def close_input(self) -> None:
        self.channel.shutdown_write()

    def events(self, timeout_s: float) -> Iterator[tuple[str, object]]:
        """The protocol's events as they arrive; ends when the server's output ends. `timeout_s`: the
        longest silence between two pieces of output (each event starts the wait again)."""
        deadline = time.monotonic() + timeout_s
        self.channel.settimeout(1.0)
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                found = parse_event(line.decode("utf-8", errors="replace"))
                if found:
                    yield found
                    deadline = time.monotonic() + timeout_s
            if len(self.buffer) > MAX_LINE_BYTES:  # the server's output is not the protocol's lines
                raise ChatError(f"the chat server sent {len(self.buffer)} bytes without a line end")
            while self.channel.recv_stderr_ready():
                self.err = (self.err + self.channel.recv_stderr(65536))[-20000:]
            try:
                data = self.channel.recv(65536)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise ChatError(f"no answer from the chat server in {timeout_s:.0f} s") from None
                continue
            if not data:
                while self.channel.recv_stderr_ready():
                    self.err += self.channel.recv_stderr(65536)
                return
            self.buffer += data

    def stderr_tail(self) -> str:
        lines = [line for line in self.err.decode("utf-8", errors="replace").splitlines() if line.strip()]
        return shown(" | ".join(lines[-3:]))[-600:] or "no error output"


def stats_line(done: dict) -> str:
    """`[first token 0.12 s, 20 tokens, 19.5 tokens/s]` of a `done` event."""
    ttft, rate = done.get("ttft_s"), done.get("tokens_per_s")
    parts = [f"first token {ttft:.2f} s" if isinstance(ttft, (int, float)) else "no token",
             # the server's word: shown only as a number
             f"{done['tokens'] if isinstance(done.get('tokens'), int) else 0} tokens"]
    if isinstance(rate, (int, float)):
        parts.append(f"{rate:.1f} tokens/s")
    return "[" + ", ".join(parts) + "]"


def converse(session: Session, prompts: Iterable[str], say: Say, write: Callable[[str], None],
             ready_timeout_s: float = READY_TIMEOUT_S) -> list[dict]:
    """Wait for the server's `ready`, then send each prompt and stream its answer to `write`; each answer's
    stats line to `say`. Returns the `done` records. A server that ends early is a ChatError with its stderr."""
    events = session.events(ready_timeout_s)
    for kind, value in events:
        if kind == "ready":
            info = value if isinstance(value, dict) else {}
            load_s = info["load_s"] if isinstance(info.get("load_s"), (int, float)) else 0
            say(f"      loaded on {shown(info.get('device', '?'))} ({shown(info.get('dtype', '?'))}) in "
                f"{load_s:.1f} s; prompts shaped as the run's {shown(info.get('format', '?'))} rows")
            break
        if kind == "error":
            raise ChatError(f"the chat server failed: {shown(value)}")
    else:
        raise ChatError(f"the chat server ended before it was ready: {session.stderr_tail()}")
    done: list[dict] = []
    for prompt in prompts:
        session.send(prompt)
        for kind, value in events:
            if kind == "token":
                write(shown(str(value), block=True))
            elif kind == "done":
                write("\n")
                say(stats_line(value if isinstance(value, dict) else {}))
                done.append(value if isinstance(value, dict) else {})
                break
            elif kind == "error":
                write("\n")
                say(f"error: {shown(value)}")
                break
        else:
            raise ChatError(f"the chat server ended mid-answer: {session.stderr_tail()}")
    session.close_input()
    for _ in events:  # the rest of its output, till it ends
        pass
    return done


def typed_prompts(read: Callable[[str], str] = input) -> Iterator[str]:
    """Prompts typed at the terminal, until an empty line, `/exit` or end of input (Ctrl-D)."""
    while True:
        try:
            text = read("you> ")
        except EOFError:
            return
        if not text.strip() or text.strip() == "/exit":
            return
        if len(text) > MAX_PROMPT_CHARS:
            print(f"(over {MAX_PROMPT_CHARS} characters: not sent)")
            continue
        yield text


def chat(opts: ChatOptions, say: Say = print, write: Callable[[str], None] | None = None) -> list[dict]:
    """Check the run's adapters on the cluster, start the server on one node and talk to it."""
    write = write or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    inv = targets.load(opts.where.target, opts.where.stack)
    cl = connect(inv, opts.where.identity)
    try:
        return _chat(cl, opts, say, write)
    finally:
        cl.close()


def _chat(cl: Cluster, opts: ChatOptions, say: Say, write: Callable[[str], None]) -> list[dict]:
    inv, ctl, q = cl.inventory, cl.controller, shlex.quote
    slurm.require_controller(cl, "start the chat server")
    for path, what in ((f"{opts.output_dir}/adapter_config.json", f"run {opts.run}'s adapters"),
                       (f"{opts.base}/config.json", f"the base model of run {opts.run}")):
        if not exists(ctl, path):
            raise ChatError(f"{what}: {path} is not on the cluster (/scratch was emptied, or this is another "
                            "cluster); pick a run of this cluster with --run, or train again")
    slurm.let_admin_read(ctl, inv, opts.output_dir)
    chat_dir = f"{inv.scratch}/slurm-gpu/chat/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    name = f"{CHAT_NAME}-{uuid.uuid4().hex[:8]}"
    slurm.make_job_dir(ctl, inv, chat_dir)
    try:
        launch.put_training(ctl, chat_dir)
        say(f"fab chat: run {opts.run} (adapters {opts.output_dir}, base {opts.base}) on one node of the "
            f"{inv.target} cluster {inv.cluster_name!r}; starting {CHAT_NAME}")
        channel = ctl.create_session()
        try:
            channel.exec_command(user_command(ctl, server_command(opts, inv, chat_dir, name), slurm.job_user(inv)))
            prompts = opts.prompts if opts.prompts is not None else typed_prompts()
            session = Session(channel)
            done = converse(session, prompts, say, write)
            status = channel.recv_exit_status()
            if status and not done:
                raise ChatError(f"the chat server's step exited {status}: {session.stderr_tail()}")
            return done
        except ProtocolError as exc:
            raise ChatError(str(exc)) from None
        finally:
            channel.close()
            # A step left behind (Ctrl-C, a dropped connection) is ended: it holds a GPU.
            sudo(ctl, f"scancel --name {q(name)} --user {q(slurm.job_user(inv))}", warn=True)
    finally:
        sudo(ctl, f"rm -rf {q(chat_dir)}", warn=True)
