"""Training data: load (hub ID or local file), detect its format from the columns, validate the rows.

Three shapes (detect_format):
- Alpaca: `instruction` and `output` (required), `input` (optional; joins the prompt when non-empty);
- `prompt` / `completion`, taken as they are;
- chat: `messages`, a list of {role, content}: an optional system turn, then user and assistant turns.
The first two become TRL prompt/completion rows (text_rows), which makes TRL's SFTTrainer compute the loss on
the completion only; chat rows go through the tokenizer's chat template in training/chat.py, the loss on the
assistant turns only. Rows with an empty answer, no assistant turn or a wrong role order are counted and left
out (Rows.dropped); a file of none of the shapes fails naming the columns found and the three shapes.
Standard library only: fab runs this file alone on a node to check a data file (main).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REQUIRED_COLUMNS = ("instruction", "output")
OPTIONAL_COLUMNS = ("input",)
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")


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


def _read_csv(path: Path) -> list[dict]:
    """A CSV file whose header row names the columns (Alpaca or prompt/completion: chat needs JSON)."""
    import csv

    with path.open(encoding="utf-8", newline="") as f:
        try:
            return list(csv.DictReader(f))
        except csv.Error as e:
            raise DataError(f"{path}: not a readable CSV file ({e}); fix it") from None


READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}


# The three row shapes, by the columns that pick them (detect_format), for messages that name them.
FORMATS = {
    "alpaca": "Alpaca: instruction, output (input optional)",
    "prompt_completion": "prompt, completion",
    "chat": "messages: a list of {role, content} (system optional, then user/assistant turns)",
}
CHAT_ROLES = ("system", "user", "assistant")
# Why a row is left out (counted per kind, reported; the rest of the file trains).
EMPTY_ANSWER, NO_ASSISTANT, ROLE_ORDER = "empty answer", "no assistant turn", "wrong role order"


def detect_format(columns, source: Path | str) -> str:
    """The rows' shape from their columns: `messages` is chat, `prompt` + `completion` is prompt/completion,
    `instruction` or `output` is Alpaca (a missing Alpaca column is then named by the row check). Anything
    else is a DataError naming the columns found and the three shapes accepted."""
    found = set(columns)
    if "messages" in found:
        return "chat"
    if {"prompt", "completion"} <= found:
        return "prompt_completion"
    if found & {"instruction", "output"}:
        return "alpaca"
    shapes = "; ".join(f"({i}) {text}" for i, text in enumerate(FORMATS.values(), start=1))
    raise DataError(f"{source}: columns found: {', '.join(sorted(map(str, found))) or 'none'}; the rows must have "
                    f"one of three shapes: {shapes}")


class Rows(list):
    """Checked rows of one format, and how many rows of each bad kind were left out."""

    def __init__(self, rows=(), fmt: str = "alpaca", dropped: dict[str, int] | None = None):
        super().__init__(rows)
        self.format = fmt
        self.dropped = dict(dropped or {})

    def extend_from(self, other: Rows, source) -> None:
        if self and other.format != self.format:
            raise DataError(f"{source}: {other.format} rows after {self.format} rows; one data set has one format")
        self.format = other.format
        self.extend(other)
        for kind, n in other.dropped.items():
            self.dropped[kind] = self.dropped.get(kind, 0) + n

    def summary(self) -> str:
        """`12 valid rows, format chat (column messages); left out: 1 empty answer` (printed and recorded)."""
        text = f"{len(self)} valid rows, format {self.format} ({FORMATS[self.format]})"
        if self.dropped:
            text += "; left out: " + ", ".join(f"{n} {kind}" for kind, n in sorted(self.dropped.items()))
        return text


def _string(row: dict, column: str, i: int, path, optional: bool = False) -> str:
    value = row.get(column)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{path}: column '{column}' in row {i} must be a string, got {type(value).__name__}")
    return value


def _require(row: dict, columns: tuple[str, ...], i: int, path, optional: str = "") -> None:
    for column in columns:
        if column not in row:
            raise DataError(f"{path}: missing column '{column}' (row {i}); every row needs "
                            f"{', '.join(columns)}{optional}")


def _chat_problem(messages: list[dict[str, str]]) -> str | None:
    """Why a conversation cannot be trained on (a bad-row kind), or None: an optional system turn first,
    then user and assistant turns in turn, ending on a non-empty assistant turn."""
    turns = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not any(m["role"] == "assistant" for m in turns):
        return NO_ASSISTANT
    if any(m["role"] != ("user" if k % 2 == 0 else "assistant") for k, m in enumerate(turns)) or len(turns) % 2:
        return ROLE_ORDER
    if any(not m["content"].strip() for m in turns if m["role"] == "assistant"):
        return EMPTY_ANSWER
    return None


def _chat_messages(row: dict, i: int, path) -> list[dict[str, str]]:
    messages = row.get("messages")
    if not isinstance(messages, list):
        raise DataError(f"{path}: column 'messages' in row {i} must be a list of {{role, content}} objects, "
                        f"got {type(messages).__name__}")
    clean = []
    for k, m in enumerate(messages, start=1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{path}: message {k} of row {i} must be an object with string 'role' and 'content'")
        clean.append({"role": m["role"], "content": m["content"]})
    return clean


def _check_rows(rows: list, path: Path | str) -> Rows:
    """Rows of the shape their columns name (detect_format), checked; rows of a bad kind (an empty answer;
    for chat also no assistant turn or a wrong role order) are counted and left out. A structural fault (a row
    that is no object, a missing column, a value of the wrong type) is a DataError."""
    if not rows:
        raise DataError(f"{path}: the data set is empty; it needs rows with columns {', '.join(REQUIRED_COLUMNS)}")
    if not isinstance(rows[0], dict):
        raise DataError(f"{path}: row 1 is not an object with columns {', '.join(REQUIRED_COLUMNS)}")
    fmt = detect_format(rows[0].keys(), path)
    clean, dropped = Rows(fmt=fmt), {}
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} is not an object with columns {', '.join(REQUIRED_COLUMNS)}")
        problem = None
        if fmt == "alpaca":
            _require(row, REQUIRED_COLUMNS, i, path, " (and optionally input)")
            fixed = {c: _string(row, c, i, path, optional=c in OPTIONAL_COLUMNS)
                     for c in REQUIRED_COLUMNS + OPTIONAL_COLUMNS}
            problem = None if fixed["output"].strip() else EMPTY_ANSWER
        elif fmt == "prompt_completion":
            _require(row, ("prompt", "completion"), i, path)
            fixed = {c: _string(row, c, i, path) for c in ("prompt", "completion")}
            problem = None if fixed["completion"].strip() else EMPTY_ANSWER
        else:
            _require(row, ("messages",), i, path)
            fixed = {"messages": _chat_messages(row, i, path)}
            problem = _chat_problem(fixed["messages"])
        if problem:
            dropped[problem] = dropped.get(problem, 0) + 1
        else:
            clean.append(fixed)
    clean.dropped = dropped
    if not clean:
        raise DataError(f"{path}: no row can be trained on ({clean.summary()}); fix the rows")
    return clean


def check_rows(rows: list, source: Path | str) -> Rows:
    """The rows checked as a data file's are (_check_rows): fab checks a local file's first rows with it."""
    return _check_rows(rows, source)


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


def load_local_rows(source: str | os.PathLike) -> Rows:
    """Read and validate a local JSON / JSONL / Parquet file, or a directory of them (one format)."""
    path = Path(source).expanduser()
    rows = Rows()
    for file in _local_files(path):
        try:
            rows.extend_from(_check_rows(READERS[file.suffix](file), file), file)
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


def load_hub_rows(name: str, split: str, config: str | None, n_examples: int | None) -> Rows:
    """Rows of a hub data set (cached under HF_HOME); the first n_examples of `split`."""
    from datasets import load_dataset

    if n_examples:
        split = f"{split}[:{n_examples}]"
    ds = load_dataset(name, name=config, split=split)
    if detect_format(ds.column_names, name) == "alpaca":
        missing = [c for c in REQUIRED_COLUMNS if c not in ds.column_names]
        if missing:
            raise DataError(f"{name}: missing column '{missing[0]}'; the data set needs {', '.join(REQUIRED_COLUMNS)}")
    return _check_rows(ds.to_list(), name)


def load_rows(source: str, split: str = "train", config: str | None = None,
              n_examples: int | None = None) -> Rows:
    """The checked rows of `source` (a local file or directory, or a hub ID): the first `n_examples` valid
    rows (all when n_examples is None or 0), in file order, so every rank sees the same data."""
    if n_examples is not None and n_examples < 0:
        raise DataError(f"n_examples must be >= 0 (0 means all rows), got {n_examples}")
    if not is_local(source):
        return load_hub_rows(source, split, config, n_examples)
    rows = load_local_rows(source)
    if n_examples:
        rows[n_examples:] = []
    return rows


def text_rows(rows: Rows) -> list[dict[str, str]]:
    """Alpaca or prompt/completion rows as TRL prompt/completion rows (the loss on the completion only)."""
    if rows.format == "alpaca":
        return [{"prompt": format_prompt(r["instruction"], r["input"]), "completion": r["output"]} for r in rows]
    if rows.format == "prompt_completion":
        return [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows]
    raise DataError("chat rows go through the tokenizer's chat template (training/chat.py), not a text prompt")


def load_instruction_dataset(source: str, split: str = "train", config: str | None = None,
                             n_examples: int | None = None):
    """A validated `datasets.Dataset` of prompt/completion rows (Alpaca or prompt/completion files)."""
    from datasets import Dataset

    return Dataset.from_list(text_rows(load_rows(source, split, config, n_examples)))


def main(argv: list[str]) -> int:
    """`python data.py FILE`: print FILE's count of valid rows (stdout) and a line with its format and the rows
    left out (stderr), or its problem (stderr) and exit 3.

    `fab train` copies this file alone to a GPU node and runs it there, before training/ is
    uploaded anywhere (so it imports nothing else of the package)."""
    import sys

    try:
        rows = load_local_rows(argv[0])
        print(len(rows))
        print(rows.summary(), file=sys.stderr)
    except DataError as exc:
        print(exc, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
