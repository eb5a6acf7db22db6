"""What every `fab` flag check shares: its error, and the one parser of number flags.

A module of its own (imported by ops/actions/options.py and ops/cost/) so that the cost
modules can parse their flags without importing the task options, which import them.
"""

from __future__ import annotations

import math
import re

from cluster.errors import UserError

# Numbers as flags are written: ASCII digits only. Python's int() and float() also take '٣' (any Unicode
# digit), '1_000', 'nan' and 'inf', which no flag means.
_ASCII_INT = re.compile(r"[+-]?[0-9]+")
_ASCII_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


MAX_CHARS = 40  # the longest number flag text taken


class OptionError(UserError, ValueError):
    pass


def number(flag: str, value, kind: type = float, what: str | None = None) -> int | float:
    """A number flag's value, as `kind` (int or float): the one parser of every number flag of `fab`.

    Only ASCII digits (a sign, a decimal point and an exponent for floats) count, and the value must be
    finite; the range (positive, at least 1, ...) is the caller's. `what` says what the flag wants, for
    the error ("a whole number", "a number of US dollars")."""
    text = str(value).strip()
    what = what or ("a whole number" if kind is int else "a number")
    if len(text) > MAX_CHARS:  # int() refuses over 4300 digits (ValueError): no flag means such a number
        raise OptionError(f"--{flag} must be {what}, not a value of {len(text)} characters "
                          f"(at most {MAX_CHARS}, e.g. --{flag} 2)")
    if not (_ASCII_INT if kind is int else _ASCII_DECIMAL).fullmatch(text):
        raise OptionError(f"--{flag} must be {what}, not {value!r} (digits 0-9, e.g. --{flag} 2)")
    n = kind(text)
    if not math.isfinite(n):  # 1e999 overflows to inf
        raise OptionError(f"--{flag} must be {what}, not {value!r}: a finite number")
    return n
