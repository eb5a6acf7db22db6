"""`fab train --data FILE` with a file on the user's machine (ops/finetune/upload.py): read and checked here
(sha256, rows, format) before any host is touched; a bad or missing file is refused by name."""

import hashlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest

from ops.actions import options
from ops.finetune import upload

REPO = Path(__file__).resolve().parents[2]
FAB = str(REPO / ".venv" / "bin" / "fab")


def alpaca_jsonl(path: Path, rows: int, blank_every: int = 0) -> bytes:
    lines = []
    for i in range(rows):
        lines.append(json.dumps({"instruction": f"Say {i}", "input": "", "output": f"{i}"}) + "\n")
        if blank_every and i % blank_every == 0:
            lines.append("\n")
    data = "".join(lines).encode()
    path.write_bytes(data)
    return data


def test_prepare_gives_sha256_rows_and_format_of_a_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    data = alpaca_jsonl(path, 300, blank_every=7)
    local = upload.prepare(path)
    assert local.sha256 == hashlib.sha256(data).hexdigest()
    assert (local.rows, local.size, local.format, local.name) == (300, len(data), "alpaca", "mine.jsonl")
    assert "300 rows, format alpaca" in local.describe()


def test_prepare_counts_a_last_row_without_newline_and_reads_pieces_not_the_file(tmp_path, monkeypatch):
    path = tmp_path / "pc.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n' * 5 + '{"prompt": "c", "completion": "d"}')
    monkeypatch.setattr(upload, "PIECE", 16)  # rows longer than a piece: the count and hash still hold
    local = upload.prepare(path)
    assert (local.rows, local.format) == (6, "prompt_completion")
    assert local.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_csv_with_other_columns_is_refused_naming_the_columns_and_the_shapes(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("question,answer\nwhat,that\n")
    with pytest.raises(upload.UploadError) as err:
        upload.prepare(path)
    msg = str(err.value)
    assert "columns found: answer, question" in msg and "one of three shapes" in msg, msg
    assert "nothing was uploaded" in msg and "\n" not in msg


def test_a_csv_with_alpaca_columns_is_accepted_and_its_rows_counted(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('instruction,input,output\n"a, quoted","","line one\nline two"\nb,,c\n')
    local = upload.prepare(path)
    assert (local.rows, local.format) == (2, "alpaca")


def test_a_bad_jsonl_row_is_refused_before_anything_is_uploaded(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": \n')
    with pytest.raises(upload.UploadError, match="row 2 is not valid JSON"):
        upload.prepare(path)


def test_a_large_json_document_is_refused_pointing_to_jsonl(tmp_path, monkeypatch):
    path = tmp_path / "big.json"
    path.write_text(json.dumps([{"instruction": "a", "output": "b"}] * 100))
    monkeypatch.setattr(upload, "JSON_WHOLE_MAX", 100)
    with pytest.raises(upload.UploadError, match=r"save it as JSON Lines \(\.jsonl"):
        upload.prepare(path)


def test_the_cluster_name_never_leaves_its_folder():
    assert upload.cluster_name(Path("/x/my data;rm -rf.jsonl")) == "my_data_rm_-rf.jsonl"
    assert upload.cluster_name(Path("/x/..jsonl")) == "jsonl"


@pytest.mark.parametrize("value,expected", [
    ("./missing.jsonl", "--data ./missing.jsonl: no such file on this machine"),
    ("missing.csv", "--data missing.csv: no such file on this machine"),
    ("~/surely-not-there-1234.jsonl", "no such file on this machine"),
])
def test_a_missing_local_file_is_refused_at_the_flags(value, expected):
    with pytest.raises(options.OptionError) as err:
        options.parse(target="local", data=value)
    assert expected in str(err.value) and "a Hub data set ID or an absolute path on the cluster" in str(err.value)


def test_local_files_and_cluster_paths_and_hub_ids_are_told_apart(tmp_path):
    path = tmp_path / "here.jsonl"
    alpaca_jsonl(path, 3)
    assert options.local_data_file(str(path)) == str(path)  # absolute and here: uploaded
    assert options.local_data_file("/scratch/data.jsonl") is None  # absolute, not here: on the cluster
    assert options.local_data_file("tatsu-lab/alpaca") is None  # a Hub ID
    assert options.local_data_file("s3://bucket/key.jsonl") is None
    opts = options.parse(target="local", data=str(path))
    assert (opts.data_file, opts.data_path) == (str(path), str(path))


def test_progress_bar_only_on_a_terminal_for_large_files():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    bar = upload.UploadBar("big.jsonl", 100 << 20, out=out)
    bar(50 << 20, 100 << 20)
    bar(100 << 20, 100 << 20)
    assert "uploading big.jsonl [" in out.getvalue() and "105 of 105 MB" in out.getvalue()
    plain = io.StringIO()
    upload.UploadBar("big.jsonl", 100 << 20, out=plain)(100 << 20, 100 << 20)
    assert plain.getvalue() == ""


@pytest.mark.parametrize("name,text,expected", [
    ("rows.csv", "question,answer\nwhat,that\n", "columns found: answer, question"),
    ("missing.jsonl", None, "no such file on this machine"),
])
def test_fab_train_refuses_a_bad_local_file_before_the_cluster_is_read(tmp_path, name, text, expected):
    """No cluster is needed: the refusal comes before the inventory is read or a host is touched."""
    if text is not None:
        (tmp_path / name).write_text(text)
    res = subprocess.run([FAB, "--search-root", str(REPO), "train", "--target", "local", "--data", f"./{name}"], cwd=tmp_path,
                         env={**os.environ, "SLURM_GPU_RUNS": str(tmp_path / "runs")},
                         capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and expected in out, out
    assert "Traceback" not in out and "local cluster" not in out, out  # before the inventory's line


@pytest.mark.parametrize("piece", [1, 7, 64, 1 << 20])
def test_rows_and_first_rows_hold_at_every_piece_boundary(tmp_path, monkeypatch, piece):
    """Blank and whitespace-only lines (CRLF too) are not rows, at whatever byte a piece ends."""
    rows = [json.dumps({"prompt": f"p{i}" * (i % 5), "completion": "c"}) for i in range(40)]
    text = ("\n \r\n".join(rows[:10]) + "\r\n\n\t\n" + "\n".join(rows[10:]) + "\n\n  ").encode()
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(text)
    monkeypatch.setattr(upload, "PIECE", piece)
    monkeypatch.setattr(upload, "HEAD_ROWS", 25)
    head: list[bytes] = []
    digest, count = upload._hash_and_count_lines(path, head)
    assert count == sum(1 for line in text.split(b"\n") if line.strip()) == 40
    assert digest == hashlib.sha256(text).hexdigest()
    assert [json.loads(line) for line in head] == [json.loads(r) for r in rows[:25]]


def test_the_benchmarks_peak_is_its_own_not_its_parents():
    """bench_upload's peak memory is its own process image's: started from a large parent (pytest with
    torch imported, here a 400 MB one), getrusage's maxrss would report the parent's peak (Linux keeps it
    across execve) and the 256 MB bound would fail for the wrong reason."""
    import subprocess
    import sys

    code = ("import subprocess, sys\n"
            "x = bytearray(400 << 20)\n"
            "for i in range(0, len(x), 4096): x[i] = 1\n"
            "out = subprocess.run([sys.executable, '-c', 'import benchmarks.bench_upload as b; print(b.peak_mb())'],"
            " capture_output=True, text=True, check=True).stdout\n"
            "print(out.strip())\n")
    peak = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).resolve().parents[2]).stdout)
    assert peak < 200
