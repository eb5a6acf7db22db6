"""How a step reports progress: a function of one line (print, or a test's list.append)."""

from collections.abc import Callable

Say = Callable[[str], None]
