"""Instruction data: load (hub ID or local file), validate, and format as TRL prompt/completion rows.

Rows have Alpaca's columns: `instruction` and `output` (required), `input` (optional; joins the
prompt when non-empty). The result has `prompt` and `completion` columns, which makes TRL's
SFTTrainer compute the loss on the completion (the response) only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REQUIRED_COLUMNS = ("instruction", "output")
OPTIONAL_COLUMNS = ("input",)
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


class DataError(ValueError):
    """A data set that cannot be trained on; the message names the file and what to fix."""


def format_prompt(instruction: str, input_text: str | None = "") -> str:
    """The Alpaca prompt; the `### Input:` block only when the row has an input."""
    if input_text and input_text.strip():
        return f"### Instruction:\n{instruction}\n\n### Input:\n{input_text}\n\n### Response:\n"
    return f"### Instruction:\n{instruction}\n\n### Response:\n"


def is_local(source: str) -> bool:
    """A path that exists, or that looks like a file path, is local; anything else is a hub ID."""
    return os.path.exists(source) or source.startswith(("/", "./", "../", "~")) or source.endswith(LOCAL_SUFFIXES)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg}); fix or remove that line") from None
    return rows


def _read_json(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # a .json file holding JSON Lines
            return _read_jsonl(path)
        raise DataError(f"{path}: not valid JSON at line {e.lineno} ({e.msg}); fix the file") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects with columns {', '.join(REQUIRED_COLUMNS)}")
    return data


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: cannot read as Parquet ({e}); check the file") from None


READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}


def _check_rows(rows: list, path: Path | str) -> list[dict[str, str]]:
    """Each row an object with string instruction/output (input optional, null -> "")."""
    if not rows:
        raise DataError(f"{path}: the data set is empty; it needs rows with columns {', '.join(REQUIRED_COLUMNS)}")
    clean = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} is not an object with columns {', '.join(REQUIRED_COLUMNS)}")
        for column in REQUIRED_COLUMNS:
            if column not in row:
                raise DataError(
                    f"{path}: missing column '{column}' (row {i}); every row needs "
                    f"{', '.join(REQUIRED_COLUMNS)} (and optionally input)"
                )
        fixed = {}
        for column in REQUIRED_COLUMNS + OPTIONAL_COLUMNS:
            value = row.get(column)
            if value is None and column in OPTIONAL_COLUMNS:
                value = ""
            if not isinstance(value, str):
                raise DataError(f"{path}: column '{column}' in row {i} must be a string, got {type(value).__name__}")
            fixed[column] = value
        if not fixed["output"].strip():
            raise DataError(f"{path}: column 'output' in row {i} is empty; there is nothing to train on")
        clean.append(fixed)
    return clean


def _local_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in LOCAL_SUFFIXES)
        if not files:
            raise DataError(f"{path}: no {', '.join(LOCAL_SUFFIXES)} files in this directory")
        return files
    if not path.exists():
        raise DataError(f"{path}: no such data file; set dataset_name to a hub ID or an existing file")
    if path.suffix not in LOCAL_SUFFIXES:
        raise DataError(f"{path}: unsupported file type '{path.suffix}'; use one of {', '.join(LOCAL_SUFFIXES)}")
    return [path]


def load_local_rows(source: str | os.PathLike) -> list[dict[str, str]]:
    """Read and validate a local JSON / JSONL / Parquet file, or a directory of them."""
    path = Path(source).expanduser()
    rows = []
    for file in _local_files(path):
        try:
            rows.extend(_check_rows(READERS[file.suffix](file), file))
        except UnicodeDecodeError:
            raise DataError(_not_utf8(file)) from None
    return rows


def _not_utf8(file: Path) -> str:
    """Where a text data file stops being UTF-8, and how to fix it."""
    raw = file.read_bytes()
    try:
        raw.decode("utf-8")
        return f"{file}: not UTF-8 text; save it as UTF-8"
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        return (f"{file}: not UTF-8 text (line {line}, byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                f"save it as UTF-8, e.g. `iconv -f latin1 -t utf-8 {file.name} > {file.stem}.utf8{file.suffix}`")


def load_hub_rows(name: str, split: str, config: str | None, n_examples: int | None) -> list[dict[str, str]]:
    """Rows of a hub data set (cached under HF_HOME); the first n_examples of `split`."""
    from datasets import load_dataset

    if n_examples:
        split = f"{split}[:{n_examples}]"
    ds = load_dataset(name, name=config, split=split)
    missing = [c for c in REQUIRED_COLUMNS if c not in ds.column_names]
    if missing:
        raise DataError(f"{name}: missing column '{missing[0]}'; the data set needs {', '.join(REQUIRED_COLUMNS)}")
    return _check_rows(ds.to_list(), name)


def load_instruction_dataset(source: str, split: str = "train", config: str | None = None,
                             n_examples: int | None = None):
    """A validated `datasets.Dataset` of prompt/completion rows: the first `n_examples` of `source`
    (all rows when n_examples is None or 0), in file order, so every rank sees the same data."""
    from datasets import Dataset

    if n_examples is not None and n_examples < 0:
        raise DataError(f"n_examples must be >= 0 (0 means all rows), got {n_examples}")
    if is_local(source):
        rows = load_local_rows(source)
        if n_examples:
            rows = rows[:n_examples]
    else:
        rows = load_hub_rows(source, split, config, n_examples)
    return Dataset.from_list([
        {"prompt": format_prompt(r["instruction"], r["input"]), "completion": r["output"]} for r in rows
    ])


def main(argv: list[str]) -> int:
    """`python data.py FILE`: print FILE's count of valid rows, or its problem and exit 3.

    `fab train` copies this file alone to a GPU node and runs it there, before training/ is
    uploaded anywhere (so it imports nothing else of the package)."""
    import sys

    try:
        print(len(load_local_rows(argv[0])))
    except DataError as exc:
        print(exc, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
