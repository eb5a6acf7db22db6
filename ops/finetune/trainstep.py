"""`fab train`'s error and its numbered progress lines ("[n/7] ..."), shared by the modules of its steps."""

from __future__ import annotations

from cluster.errors import UserError
from ops.say import Say

STEPS = 7


class TrainError(UserError, RuntimeError):
    pass


def step(say: Say, n: int, text: str) -> None:
    say(f"[{n}/{STEPS}] {text}")

