"""The line protocol of `fab chat`: how fab (ops/finetune/chat_session.py) and the chat server (training/talk.py) talk
through the Slurm step's stdin and stdout.

Standard library only: fab imports it on the user's machine, the server beside the model.

fab -> server, one line per prompt on stdin: `{"prompt": "..."}` (JSON, so a prompt may hold newlines and any
character; a prompt never reaches a command line or a shell). End of input ends the server.

server -> fab, on stdout: `SLURM_GPU_CHAT {json}` lines, each JSON object with one key:
- `ready`: the model and adapters are loaded (`{"device", "dtype", "load_s", "format"}`);
- `token`: the next piece of the answer's text, as the tokenizer decodes it (streamed);
- `done`: the answer ended (`{"ttft_s", "tokens", "tokens_per_s", "seconds"}`): time to the first token, new
  tokens, their rate after the first one;
- `error`: a prompt that could not be answered (the server goes on with the next one).
Any other line (srun's, a library's warning) is not part of the protocol: fab ignores it.
"""

from __future__ import annotations

import json

TAG = "SLURM_GPU_CHAT"
KINDS = ("ready", "token", "done", "error")
MAX_PROMPT_CHARS = 100_000  # a prompt longer than this is refused by fab, before the cluster


class ProtocolError(ValueError):
    pass


def prompt_line(prompt: str) -> str:
    """One prompt as the server's stdin line (newline included)."""
    return json.dumps({"prompt": prompt}, ensure_ascii=True) + "\n"


def read_prompt(line: str) -> str:
    """The prompt of one stdin line; ProtocolError for a line that is not `{"prompt": "text"}`."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"not a JSON line: {exc}") from None
    if not isinstance(data, dict) or set(data) != {"prompt"} or not isinstance(data["prompt"], str):
        raise ProtocolError('a line must be {"prompt": "text"}')
    return data["prompt"]


def event(kind: str, value) -> str:
    """One server line (no newline): `SLURM_GPU_CHAT {"kind": value}`."""
    if kind not in KINDS:
        raise ValueError(f"unknown chat event {kind!r}")
    return f"{TAG} {json.dumps({kind: value}, ensure_ascii=True)}"


def parse_event(line: str) -> tuple[str, object] | None:
    """(kind, value) of a server line; None for a line that is not the protocol's (srun's, a warning).
    A tagged line that is malformed is a ProtocolError."""
    line = line.rstrip("\r\n")
    if not line.startswith(TAG + " "):
        return None
    try:
        data = json.loads(line[len(TAG) + 1:])
    except ValueError as exc:
        raise ProtocolError(f"malformed chat line ({exc}): {line[:200]!r}") from None
    if not isinstance(data, dict) or len(data) != 1 or next(iter(data)) not in KINDS:
        raise ProtocolError(f"malformed chat line: {line[:200]!r}")
    kind, value = next(iter(data.items()))
    return kind, value
