"""`@cluster_task`: the shape every `fab` task that reaches a cluster shares (fabfile.py).

A task is written as `def status(c, where, <its own flags>)` with a docstring. The decorator
- adds the flags every such task takes, --target, --stack and --identity (help: ops/actions/options.py's
  CLUSTER_FLAGS_HELP), and hands the task them checked, as `where` (an `options.ClusterOptions`);
- checks the task's own flags that `FLAG_PARSERS` names (--job, the host of `fab ssh`) first: their
  fix does not depend on the cluster;
- ends a known failure (bad flags, an unreachable host, a refused key, a failed job ...) with its
  message on one line, `fab TASK: ...`, exit 1 and no traceback; Ctrl-C exits 130.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from invoke import task
from invoke.exceptions import Exit
from paramiko.ssh_exception import AuthenticationException, NoValidConnectionsError, SSHException

from cluster.errors import UserError
from ops.actions import options

COMMON_FLAGS = tuple(options.CLUSTER_FLAGS_HELP)  # target, stack, identity
FLAG_PARSERS: dict[str, Callable] = {"job": options.parse_job, "host": options.parse_host}


def identity_of(c, identity: str | None) -> str | None:
    """--identity, else `fab -i KEY` (Fabric's own flag), else None (the inventory's key)."""
    if identity:
        return identity
    keys = c.config.connect_kwargs.get("key_filename") if hasattr(c, "config") else None
    return (keys[0] if isinstance(keys, list) and keys else keys) or None


def _one_line(name: str, exc: BaseException, identity: str | None) -> Exit:
    if isinstance(exc, AuthenticationException):
        key = identity or "the inventory's ssh_key_file"
        return Exit(f"fab {name}: the cluster refused the SSH key ({key}): {exc} The cluster is reachable; the "
                    "key is wrong. Pass --identity with the private key whose public half the cluster was "
                    "deployed with (slurm-gpu:sshPublicKey; locally the inventory's key).", code=1)
    if isinstance(exc, (NoValidConnectionsError, SSHException, TimeoutError)):
        return Exit(f"fab {name}: cannot reach the cluster ({exc}). Is it up (`fab status`, `fab local.up`, "
                    "`pulumi up`), and is your address inside slurm-gpu:adminCidr?", code=1)
    return Exit(f"fab {name}: {exc}", code=1)


def cluster_task(help: dict[str, str] | None = None, positional: tuple[str, ...] = ()):
    """An invoke task of `fn(c, where, **own_flags)`; `help` documents its own flags."""

    def decorate(fn):
        own = list(inspect.signature(fn).parameters.values())[2:]  # after (c, where)
        common = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
                  for name in COMMON_FLAGS]
        context = inspect.Parameter("c", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        signature = inspect.Signature([context, *own, *common])  # what invoke turns into flags

        @functools.wraps(fn)
        def run(*args, **kwargs):
            flags = signature.bind(*args, **kwargs)
            flags.apply_defaults()
            c, *_ = flags.args
            given = {name: flags.arguments[name] for name in COMMON_FLAGS}
            own_flags = {p.name: flags.arguments[p.name] for p in own}
            try:
                for name, parse in FLAG_PARSERS.items():
                    if name in own_flags:
                        own_flags[name] = parse(own_flags[name])
                where = options.parse_cluster(target=given["target"], stack=given["stack"],
                                              identity=identity_of(c, given["identity"]))
                return fn(c, where, **own_flags)
            except (UserError, AuthenticationException, NoValidConnectionsError, SSHException,
                    TimeoutError) as exc:
                raise _one_line(fn.__name__, exc, identity_of(c, given["identity"])) from None
            except KeyboardInterrupt:
                raise Exit(code=130) from None

        run.__signature__ = signature
        return task(positional=list(positional), help={**options.CLUSTER_FLAGS_HELP, **(help or {})})(run)

    return decorate
