"""Text from the cluster reaches the admin's terminal with its control characters escaped (review of
issue 44, finding 7): a job, a node or a Slurm reason can hold ESC sequences (OSC 52 writes the
clipboard, CSI moves the cursor or clears the screen); fab prints them as `\\x1b...`, never raw.

Each case goes through the real printing path (ops/say.shown at the boundary) and reads stdout."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ops.actions import cloudinit
from ops.finetune import job_end, runs, spot_notice, stream
from ops.finetune.joblog import JobLog
from ops.say import shown

OSC52 = "\x1b]52;c;ZWNobyBoaQ==\x07"  # "put `echo hi` in the clipboard"
CSI = "\x1b[2J\x1b[1;1H"  # clear the screen, cursor home
C1_CSI = "\x9b31m"  # the one-byte CSI of 8-bit terminals
HOSTILE = f"a{OSC52}b{CSI}c{C1_CSI}d\x7fe\x08f"


def _clean(out: str) -> None:
    """No control character a terminal acts on in `out` (newlines and tabs aside)."""
    bad = [c for c in out if (ord(c) < 32 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f]
    assert not bad, (bad, out)


def test_shown_escapes_c0_del_and_c1_but_keeps_tabs_and_a_blocks_newlines():
    assert shown(HOSTILE) == "a\\x1b]52;c;ZWNobyBoaQ==\\x07b\\x1b[2J\\x1b[1;1Hc\\x9b31md\\x7fe\\bf"
    assert shown("a\tb\nc\rd") == "a\tb\\nc\\rd"  # one line stays one line
    assert shown("a\tb\r\nc\rd\n", block=True) == "a\tb\nc\nd\n"  # a lone CR cannot overwrite a line
    assert shown("plain text: loss 2.1, ünïcode") == "plain text: loss 2.1, ünïcode"
    assert shown(12) == "12"


class _Conn:
    """A Connection whose commands answer with the text a test gives, by command prefix."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers

    def run(self, cmd: str, **kw) -> SimpleNamespace:
        out = next((a for prefix, a in self.answers.items() if cmd.startswith(prefix)), "")
        return SimpleNamespace(ok=True, stdout=out, stderr="")


def test_fab_logs_streams_a_hostile_log_line_escaped(capsys):
    data = f"0: step 1\n1: {HOSTILE}\n2: progress 10%\rprogress 20%\n".encode()
    stream._report(JobLog(), data, print, raw=True)
    out = capsys.readouterr().out
    _clean(out)
    assert "1: a\\x1b]52;c;ZWNobyBoaQ==\\x07b\\x1b[2J" in out
    assert "0: step 1\n" in out and "progress 10%\nprogress 20%" in out


def test_the_job_logs_error_and_tail_lines_are_escaped():
    log = JobLog()
    log.feed(f"0: RuntimeError: {OSC52}boom\n1: {CSI}last words\n")
    err = job_end.failure("7", stream.Followed(None, log), "/scratch/logs/x.out")
    _clean(str(err))
    assert "RuntimeError: \\x1b]52;c;" in str(err) and "\\x1b[2J\\x1b[1;1Hlast words" in str(err)


def test_a_metrics_value_never_reaches_fab_runs_job_raw(tmp_path, capsys):
    """A job writes metrics.json: a value where fab expects a number is refused (summary.py), and the refusal
    shows the value escaped; what `fab runs` prints of a good file has no control character either."""
    d = tmp_path / "5"
    d.mkdir()
    (d / "metrics.json").write_text(json.dumps({"train_steps": OSC52, "world_size": CSI}))
    with pytest.raises(runs.RunsError) as err:
        runs.show(tmp_path, "5")
    _clean(str(err.value))
    assert "\\x1b]52" in str(err.value)
    (d / "metrics.json").write_text(json.dumps({"train_steps": 3, "world_size": 2}))
    for line in [*runs.show(tmp_path, "5"), *runs.table(tmp_path)]:  # as fabfile.py's `runs` task prints them
        print(line)
    _clean(capsys.readouterr().out)


def test_a_sinfo_reason_reaches_the_spot_line_escaped(capsys):
    log = JobLog()
    log.feed('SLURM_GPU_JOB {"job_id": "7", "restart": 0, "nodes": "gpu-node-01"}\n')
    ctl = _Conn({"sinfo": f"gpu-node-01|{spot_notice.REASON_PREFIX} terminate {OSC52}{CSI}\n"})
    data = b'0: SLURM_GPU_SPOT {"kind": "interruption", "step": 12, "checkpoint": "c", "stop": true}\n'
    stream._report(log, data, print, raw=False, explain=lambda ev: spot_notice.describe(ctl, log, ev))
    out = capsys.readouterr().out
    _clean(out)
    assert "gpu-node-01" in out and "terminate \\x1b]52;c;ZWNobyBoaQ==\\x07\\x1b[2J" in out


def test_a_failed_bootstrap_steps_log_tail_is_escaped():
    conn = _Conn({"for f in": "wheels failed exit 1 at line 3 2026-12-07\n",
                  "tail -n": f"pip: {OSC52}\ncollecting {CSI}x\n"})
    text = cloudinit.bootstrap_failure(conn)
    _clean(text)
    assert "      | pip: \\x1b]52;c;ZWNobyBoaQ==\\x07\n      | collecting \\x1b[2J" in text
