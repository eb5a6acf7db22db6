"""The one shell-quoting filter of the project's Jinja2 templates (`| shquote`).

Both template sets that make bash (bootstrap/scripts/ and jobs/) register it, so a value reaches a
shell the same way wherever it is rendered. It always single-quotes, even a word bash would take as
is (unlike `shlex.quote`): the rendered scripts read the same whatever the value, and a value
is never code (bash(1), QUOTING: "Enclosing characters in single quotes preserves the literal value
of each character within the quotes"; a single quote itself is closed, escaped and reopened).
"""

from __future__ import annotations


def shell_quote(value) -> str:
    """`value` as one single-quoted bash word."""
    return "'" + str(value).replace("'", "'\"'\"'") + "'"
