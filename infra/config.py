"""The stack's settings as the Pulumi program gets them: `pulumi.Config` fed to the one parse
(cluster/stack_config.py), and PlanError, the refusal Pulumi prints without a traceback.

Every refusal is raised before the program declares any resource (infra/program.py).
"""

from __future__ import annotations

import pulumi

from cluster.settings import NAMESPACE, SETTINGS
from cluster.stack_config import ConfigError, StackConfig


class PlanError(ConfigError, pulumi.RunError):
    """A bad setting or a plan-time refusal. RunError makes Pulumi print the message without a traceback."""


def load(config: pulumi.Config | None = None) -> StackConfig:
    """Read every `slurm-gpu:` setting of the current stack and validate it."""
    config = config or pulumi.Config(NAMESPACE)
    raw = {key: config.get(key) for key in SETTINGS}
    raw = {k: v for k, v in raw.items() if v is not None}
    raw.update({k: True for k in _unknown_keys()})
    try:
        return StackConfig.from_mapping(raw)
    except ConfigError as exc:
        raise PlanError(str(exc)) from None


def _unknown_keys() -> list[str]:
    """`slurm-gpu:` keys set on the stack that the program does not know (typos)."""
    from pulumi.runtime import config as runtime_config

    keys = set(runtime_config.CONFIG.get()) | set(runtime_config.get_config_env())
    prefix = NAMESPACE + ":"
    return [k[len(prefix):] for k in keys if k.startswith(prefix) and k[len(prefix):] not in SETTINGS]
