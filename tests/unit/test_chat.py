"""`fab chat` off the cluster: its line protocol, its flags and the run they name (checked before any host is
touched), and the chat server answering real prompts with the tiny model and real LoRA adapters on CPU."""

import io
import json
import subprocess
from pathlib import Path

import pytest

from ops.actions.options import OptionError, parse_cluster
from ops.finetune import chat_session as chat
from training import talk_protocol as proto

REPO = Path(__file__).resolve().parents[2]
JOB_DIR = "/scratch/slurm-gpu/jobs/20260101-000000-abcdef"
BASE = "/scratch/tiny/model"


def make_run(runs: Path, name: str, adapters: bool = True, base: str = BASE, target: str = "local",
             data_format: str | None = "alpaca", job_dir: str = JOB_DIR) -> Path:
    d = runs / name
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps(
        {"choices": {"data_format": {"value": data_format, "by": "auto"}}} if data_format else {}))
    (d / "run.json").write_text(json.dumps({"target": target}))
    (d / "job_dir").write_text(job_dir + "\n")
    if adapters:
        (d / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
        (d / "adapter_model.safetensors").write_bytes(b"x")
    return d


def parse(runs, **kw):
    return chat.parse(parse_cluster(target="local"), runs_root=runs, **kw)


# ---------------------------------------------------------------- the protocol


def test_a_prompt_crosses_as_one_json_line_whatever_it_holds():
    text = 'two\nlines, "quotes", $(rm -rf /) `x` \\ and \u00e9'
    line = proto.prompt_line(text)
    assert line.endswith("\n") and line.count("\n") == 1
    assert proto.read_prompt(line) == text


@pytest.mark.parametrize("line", ["hello", "[1]", '{"prompt": 3}', '{"prompt": "a", "x": 1}'])
def test_a_line_that_is_no_prompt_is_refused(line):
    with pytest.raises(proto.ProtocolError):
        proto.read_prompt(line)


def test_server_lines_are_told_from_other_output():
    assert proto.parse_event(proto.event("token", "Lima\n") + "\n") == ("token", "Lima\n")
    assert proto.parse_event("srun: job 5 queued and waiting for resources") is None
    assert proto.parse_event("warning: SLURM_GPU_CHAT in the middle") is None
    with pytest.raises(proto.ProtocolError):
        proto.parse_event('SLURM_GPU_CHAT {"shell": "x"}')
    with pytest.raises(proto.ProtocolError):
        proto.parse_event("SLURM_GPU_CHAT not json")


# ---------------------------------------------------------------- flags and the run, before the cluster


def test_the_newest_run_with_adapters_is_the_default(tmp_path):
    import os
    import time

    make_run(tmp_path, "3")
    unfinished = make_run(tmp_path, "4", adapters=False)
    now = time.time()
    os.utime(tmp_path / "3" / "metrics.json", (now - 100, now - 100))
    os.utime(unfinished / "metrics.json", (now, now))
    opts = parse(tmp_path, prompt="hi")
    assert (opts.run, opts.output_dir, opts.base, opts.format) == ("3", f"{JOB_DIR}/output", BASE, "alpaca")
    assert opts.prompts == ("hi",) and opts.max_new_tokens == chat.DEFAULT_MAX_NEW_TOKENS


def test_the_run_format_shapes_the_prompt(tmp_path):
    make_run(tmp_path, "5", data_format="chat")
    assert parse(tmp_path, run="5").format == "chat"
    make_run(tmp_path, "6", data_format=None)  # a run from before the format was recorded: Alpaca
    assert parse(tmp_path, run="6").format == "alpaca"
    assert parse(tmp_path, run="6").prompts is None  # no prompt flag: interactive


@pytest.mark.parametrize(("kw", "words"), [
    ({"run": "9"}, "--run 9: no such run"),
    ({"run": "../etc"}, "is not a run's name"),
    ({"run": "4"}, "has no adapters"),
    ({"run": "7"}, "trained on the aws cluster"),
    ({"run": "8"}, "not a path on the cluster"),
    ({"run": "10"}, "does not name its job folder"),
    ({"run": "3", "prompt": "a", "prompts_file": "f"}, "pass one of them"),
    ({"run": "3", "prompt": "  "}, "--prompt is empty"),
    ({"run": "3", "prompts_file": "/nonexistent/prompts.txt"}, "no such file"),
    ({"run": "3", "prompts_file": "EMPTY"}, "holds no prompt"),
    ({"run": "3", "prompts_file": "BINARY"}, "not UTF-8"),
    ({"run": "3", "max_new_tokens": "0"}, "--max-new-tokens must be 1 to 32768"),
    ({"run": "3", "max_new_tokens": "many"}, "--max-new-tokens"),
])
def test_bad_input_is_one_clear_error_before_the_cluster(tmp_path, kw, words):
    runs = tmp_path / "runs"
    make_run(runs, "3")
    make_run(runs, "4", adapters=False)
    make_run(runs, "7", target="aws")
    make_run(runs, "8", base="Qwen/Qwen3-4B")
    make_run(runs, "10", job_dir="relative/../dir")
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00")
    files = {"EMPTY": str(tmp_path / "empty.txt"), "BINARY": str(tmp_path / "binary.txt")}
    if "prompts_file" in kw:
        kw = {**kw, "prompts_file": files.get(kw["prompts_file"], kw["prompts_file"])}
    with pytest.raises(OptionError) as err:
        parse(runs, **kw)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_no_run_at_all_names_fab_train(tmp_path):
    with pytest.raises(OptionError, match="no run with adapters under .*`fab train`"):
        parse(tmp_path, prompt="hi")


def test_the_server_command_quotes_every_value_and_holds_no_prompt(tmp_path):
    make_run(tmp_path, "3", base="/scratch/my model")
    opts = parse(tmp_path, run="3", prompt="$(reboot)")

    class Inv:
        scratch, python, target = "/scratch", "/usr/bin/python3", "local"
        facts = None

    cmd = chat.server_command(opts, Inv(), "/scratch/slurm-gpu/chat/x", "slurm-gpu-chat-1")
    assert "--base '/scratch/my model'" in cmd and "reboot" not in cmd
    assert cmd.startswith("srun --nodes=1 --ntasks=1 --gres=gpu:1 ")


def test_typed_prompts_end_on_an_empty_line_exit_or_eof():
    said = iter(["one", "two", "", "three"])
    assert list(chat.typed_prompts(lambda _p: next(said))) == ["one", "two"]
    said = iter(["one", "/exit"])
    assert list(chat.typed_prompts(lambda _p: next(said))) == ["one"]

    def eof(_p):
        raise EOFError

    assert list(chat.typed_prompts(eof)) == []


def test_fab_list_shows_the_chat_task_with_its_docstring():
    out = subprocess.run([str(REPO / ".venv" / "bin" / "fab"), "--list"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert "chat            Talk to a run's tuned adapters" in out


# ---------------------------------------------------------------- the server, on CPU with the tiny model


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny model (training.make_tiny) and LoRA adapters of random (non-zero) weights on it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from training import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    make_tiny.main(["--out", str(root), "--examples", "20"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(root / "model")
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(root / "adapters")
    return str(root / "model"), str(root / "adapters")


@pytest.mark.slow
def test_the_server_streams_answers_from_the_adapters_and_survives_a_bad_line(tiny_run):
    from training import talk

    base, adapters = tiny_run
    model, tok = talk.load(base, adapters, "cpu")
    lines = [proto.prompt_line("What is the capital of Peru?"), "not json\n", proto.prompt_line("Add 2\nand 3.")]
    out = io.StringIO()
    assert talk.serve(model, tok, "alpaca", 6, lines, out) == 2
    events = [proto.parse_event(line) for line in out.getvalue().splitlines()]
    kinds = [k for k, _ in events]
    assert kinds.count("done") == 2 and kinds.count("error") == 1 and "token" in kinds
    first = kinds.index("done")
    streamed = "".join(v for k, v in events[:first] if k == "token")
    stats = events[first][1]
    assert stats["tokens"] == 6 and stats["ttft_s"] > 0 and stats["tokens_per_s"] > 0
    # the streamed text is the adapters' greedy answer, and not the base model's
    expected = talk.answer(model, tok, talk.prompt_text(tok, "alpaca", "What is the capital of Peru?"), 6)["text"]
    assert streamed == expected
    with model.disable_adapter():
        plain = talk.answer(model, tok, talk.prompt_text(tok, "alpaca", "What is the capital of Peru?"), 6)["text"]
    assert plain != expected


def test_a_chat_run_gets_the_chat_template(tiny_run):
    from transformers import AutoTokenizer

    from training import talk

    tok = AutoTokenizer.from_pretrained(tiny_run[0])
    assert talk.prompt_text(tok, "chat", "hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert talk.prompt_text(tok, "alpaca", "hi") == "### Instruction:\nhi\n\n### Response:\n"
    assert talk.prompt_text(tok, "prompt_completion", "hi") == "hi"


class PipeChannel:
    """The server run as a local process, behind the part of paramiko's Channel that Session uses (recv with a
    timeout, stderr, sendall, shutdown_write): the same bytes as over SSH, without the SSH."""

    def __init__(self, argv):
        import os
        import threading

        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.err = b""
        self.drain = threading.Thread(target=self._drain, daemon=True)
        self.drain.start()
        self.timeout = None

    def _drain(self):
        self.err += self.proc.stderr.read()

    def settimeout(self, t):
        self.timeout = t

    def recv(self, n):
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            raise TimeoutError
        data = self.proc.stdout.read1(n)
        if not data:  # the end of its output: all of its stderr is read too, as an SSH channel's would be
            self.drain.join(timeout=60)
        return data

    def recv_stderr_ready(self):
        return bool(self.err) and not self.drain.is_alive()

    def recv_stderr(self, n):
        out, self.err = self.err[:n], self.err[n:]
        return out

    def sendall(self, data):
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def shutdown_write(self):
        self.proc.stdin.close()


@pytest.mark.slow
def test_fab_side_streams_each_answer_and_its_stats_from_the_server_process(tiny_run):
    import sys

    base, adapters = tiny_run
    channel = PipeChannel([sys.executable, "-m", "training.talk", "--base", base, "--adapters", adapters,
                           "--max-new-tokens", "5", "--device", "cpu"])
    said, written = [], []
    done = chat.converse(chat.Session(channel), ["What is 2+2?", "line one\nline two"], said.append, written.append)
    assert channel.proc.wait(timeout=60) == 0
    assert [d["tokens"] for d in done] == [5, 5]
    assert said[0].startswith("      loaded on cpu (float32)") and "alpaca rows" in said[0]
    assert len([s for s in said if s.startswith("[first token ")]) == 2
    assert "".join(written).count("\n") >= 2


def test_a_server_that_dies_before_ready_is_named_with_its_error(tmp_path):
    import sys

    channel = PipeChannel([sys.executable, "-m", "training.talk", "--base", str(tmp_path / "none"),
                           "--adapters", str(tmp_path / "none"), "--device", "cpu"])
    with pytest.raises(chat.ChatError, match="ended before it was ready: .*Error"):
        chat.converse(chat.Session(channel), ["hi"], print, print)
    channel.proc.wait(timeout=60)


class BytesChannel:
    """A channel that hands out fixed chunks, then silence (TimeoutError) or the end of output."""

    def __init__(self, chunks, then_end=True):
        self.chunks, self.then_end = list(chunks), then_end

    def settimeout(self, t):
        pass

    def recv(self, n):
        if self.chunks:
            return self.chunks.pop(0)
        if self.then_end:
            return b""
        raise TimeoutError

    def recv_stderr_ready(self):
        return False


def test_a_server_that_never_ends_a_line_is_stopped_not_buffered_without_end():
    """Output with no line end (a job's process, not the protocol) is refused past MAX_LINE_BYTES,
    instead of growing fab's memory and rescans for ever."""
    chunk = b"x" * (1 << 16)
    session = chat.Session(BytesChannel([chunk] * ((chat.MAX_LINE_BYTES >> 16) + 2)))
    with pytest.raises(chat.ChatError, match="without a line end"):
        list(session.events(60))


def test_the_stats_line_shows_the_servers_numbers_only():
    """A `done` record is the server's word (a job's process on a GPU node): text where a number
    belongs, terminal escapes included, never reaches the admin's terminal."""
    line = chat.stats_line({"ttft_s": 0.5, "tokens": "\x1b]52;c;ZXZpbA==\x07\x1b[2J", "tokens_per_s": "fast"})
    assert "\x1b" not in line and "\x07" not in line
    assert line == "[first token 0.50 s, 0 tokens]"
