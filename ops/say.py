"""How a step reports progress: a function of one line (print, or a test's list.append); and `shown`,
which makes text from the cluster safe to print on the admin's terminal."""

import re
from collections.abc import Callable

Say = Callable[[str], None]

# Control characters a terminal acts on: C0 (ESC starts CSI/OSC sequences: OSC 52 writes the clipboard,
# others retitle the window, move the cursor, or hide text), DEL, and C1 (0x9b is a one-byte CSI and
# 0x9d an OSC in terminals that honour 8-bit controls: ECMA-48 section 5.3). Tab is kept; a newline
# only in a block of lines.
_CONTROL_LINE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_CONTROL_BLOCK = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\b": "\\b"}


def _escaped(m: re.Match) -> str:
    ch = m.group()
    return _NAMED.get(ch, f"\\x{ord(ch):02x}")


def shown(text: object, block: bool = False) -> str:
    """`text` (remote text: a log line, a Slurm reason, a value a job wrote) with every control
    character written out as an escape (ESC -> `\\x1b`), so printing it cannot drive the terminal.

    One line (default): a newline or carriage return is escaped too, so the text stays one line.
    `block`: a multi-line block (a streamed log): newlines stay, CRLF becomes a newline, and a lone
    carriage return (a progress bar redrawing itself) starts a new line instead of letting later
    text overwrite what was printed before it on the terminal."""
    text = text if isinstance(text, str) else str(text)
    if block:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        return _CONTROL_BLOCK.sub(_escaped, text)
    return _CONTROL_LINE.sub(_escaped, text)
