"""The options of `fab`'s tasks, checked before any host is touched.

Every error names the flag and says how to fix it. The flags every cluster task shares
(--target, --stack, --identity) are declared here once, help text included (ops/actions/cluster_task.py
adds them to each task); `parse_cluster` checks them, `parse_train` the rest of `fab train`'s.
Checks that need the cluster's shape (node and GPU counts) run against the inventory, which is
read locally.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cluster import targets
from cluster.inventory import Inventory
from cluster.targets import Target
from ops.actions.flags import OptionError, number  # noqa: F401 - the flag errors and number parser, here too

REPO = Path(__file__).resolve().parents[2]
# The training configs the project ships. Without --config `fab train` takes the GPU run's on a
# cluster of real GPUs and the tiny model's elsewhere: CPU ranks train only the tiny model, which
# `fab train` makes on the cluster itself (ops/finetune/inputs.py ensure_tiny), so it needs no Hub.
TRAINING_CONFIGS = REPO / "training" / "configs"


def default_config(target: Target) -> Path:
    """The training config `fab train` uses on `target` without --config."""
    return TRAINING_CONFIGS / ("qwen3-4b-lora.yaml" if target.real_gpus else "local-tiny.yaml")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

# --help of the flags every task that reaches a cluster takes (ops/actions/cluster_task.py adds them).
CLUSTER_FLAGS_HELP = {
    "target": "aws (the current Pulumi stack, default) or local (the cluster of `fab local.up`)",
    "stack": "Pulumi stack to read the inventory from (default: the selected stack)",
    "identity": "SSH private key (default: `fab -i KEY`, else the inventory's ssh_key_file)",
}


@dataclass(frozen=True)
class TrainOptions:
    target: str
    stack: str | None
    config: Path
    nodes: int | None
    gpus_per_node: int | None
    examples: int | None
    model: str | None
    data: str | None
    identity: str | None
    # The network check before the job (skip_check: not at all); healthy_only: a node that fails it is
    # drained and the job runs on the others instead of stopping.
    skip_check: bool = False
    healthy_only: bool = False
    # Where the job will read its model and data: the flag, else the config's setting (or its default).
    config_model: str | None = None
    config_data: str | None = None
    # --max-cost: US dollars the run may cost (ops/cost/cap.py); None: no cap.
    max_cost: float | None = None
    # --down: `pulumi destroy` once the run is home and verified (ops/actions/stack_down.py).
    down: bool = False
    # --drop-unfinished (with --down): unfinished runs' checkpoints may go with the stack.
    drop_unfinished: bool = False
    # --data naming a file on this machine: uploaded to the cluster (ops/finetune/upload.py), then `data`
    # names its copy there; data_source: what the run record says of it (set once uploaded).
    data_file: str | None = None
    data_source: Mapping | None = field(default=None, compare=False)
    # The training config's settings as checked (training/validate.py), for what fab itself predicts from them
    # (the fit check, ops/cost/fit.py); a setting absent here has args.py's default.
    settings: Mapping = field(default_factory=dict, compare=False)

    @property
    def model_path(self) -> str | None:
        return self.model or self.config_model

    @property
    def data_path(self) -> str | None:
        return self.data or self.config_data


def _int(flag: str, value, low: int = 1) -> int | None:
    if value is None or value == "":
        return None
    n = number(flag, value, int)
    if n < low:
        raise OptionError(f"--{flag} must be at least {low}, not {n}")
    return n


def _model_or_data(flag: str, value: str | None, target: Target, label: str | None = None) -> str | None:
    """A flag's (or, with `label`, a config setting's) model or data location, checked for `target`."""
    if value is None:
        return None
    label = label or f"--{flag}"
    value = str(value).strip()
    if not value:
        raise OptionError(f"{label} is empty: give a Hugging Face Hub ID or an absolute path on the cluster")
    if value.startswith("/"):
        return value
    if value.startswith("s3://"):
        raise OptionError(f"{label} {value}: fab does not read S3 yet; copy the object here (`aws s3 cp {value} .`) "
                          f"and pass the file: {label} ./{value.rstrip('/').rsplit('/', 1)[-1] or 'data.jsonl'} "
                          "(uploaded once to the cluster)")
    if target.hub_offline:
        fix = (f"leave --{flag} out to use the config's" if label.startswith("--") else
               f"or pass --config {default_config(target).relative_to(REPO)} for the") + " tiny model and data"
        raise OptionError(f"{label} {value!r}: the {target.name} cluster runs offline (HF_HUB_OFFLINE=1); give an "
                          f"absolute path visible on the cluster (e.g. under /scratch), {fix}")
    if not _HUB_ID.match(value) or ".." in value:
        raise OptionError(f"{label} {value!r} is neither a Hub ID like 'Qwen/Qwen3-4B' nor an absolute "
                          "path on the cluster (paths are read on the cluster, e.g. /scratch/data.jsonl)")
    return value


# A --data value that names a file on this machine (ops/finetune/upload.py uploads it).
_DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def local_data_file(value: str | None) -> str | None:
    """--data as a file on this machine, or None. An absolute path is one when it is a file here (else it is a
    path on the cluster, as before); a relative one when it exists here or looks like a file path
    (./, ../, ~, a data file's suffix): a missing one is then refused by name (upload.prepare)."""
    if value is None:
        return None
    text = str(value).strip()
    if not text or text.startswith("s3://"):
        return None
    here = Path(text).expanduser()
    if text.startswith("/"):
        return str(here) if here.is_file() else None
    if here.exists() or text.startswith(("./", "../", "~")) or text.lower().endswith(_DATA_SUFFIXES):
        return str(here.resolve()) if here.exists() else text
    return None


def _config(value: str | None, target: Target) -> tuple[Path, dict]:
    path = Path(value).expanduser() if value else default_config(target)
    if not path.is_file():
        raise OptionError(f"--config {path}: no such file; pass a YAML file such as {default_config(target)}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise OptionError(f"--config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise OptionError(f"--config {path} must be a YAML mapping of training settings (key: value)")
    # The settings come from training/settings_schema.py's cache; only a cold one imports TRL (seconds).
    from training.validate import ConfigProblem, check_config

    try:
        check_config(data, str(path))
    except ConfigProblem as exc:
        raise OptionError(str(exc)) from None
    return path.resolve(), data


@dataclass(frozen=True)
class ClusterOptions:
    """The flags of every task that reaches a cluster: which one, and the SSH key."""
    target: str
    stack: str | None
    identity: str | None


def parse_cluster(target=None, stack=None, identity=None) -> ClusterOptions:
    """--target, --stack and --identity checked on their own (no inventory, no training config: the
    tasks other than `fab train` read no config, and checking one may import TRL: seconds)."""
    try:
        tgt = targets.get(target)
    except targets.TargetError as exc:
        raise OptionError(str(exc)) from None
    if stack and not tgt.takes_stack:
        raise OptionError("--stack names a Pulumi stack: it only goes with --target "
                          + " or ".join(targets.with_stacks()))
    if identity is not None:
        key = Path(identity).expanduser()
        if not key.is_file() or not os.access(key, os.R_OK):
            raise OptionError(f"--identity {identity}: no readable key file there; pass the private key "
                              "whose public half the cluster was deployed with")
        identity = str(key)
    return ClusterOptions(target=tgt.name, stack=stack or None, identity=identity)


# How each target without a Pulumi stack is taken down instead of `fab down` / `fab train --down`.
OTHER_WAY = {"local": "`fab local.down` takes the local cluster down",
             "boot": "`python -m boottest.teardown` removes the boot test's cluster"}


def check_down(target: str, how: str = "") -> None:
    """`fab down` and --down destroy a Pulumi stack (ops/actions/stack_down.py): a target that is none is refused,
    naming its own way down. `how`: the flag, for the message (`fab down` names itself)."""
    tgt = targets.get(target)
    if not tgt.takes_stack:
        raise OptionError(f"{how + ': ' if how else ''}the {tgt.name} cluster is not a Pulumi stack, there is "
                          f"nothing to destroy; {OTHER_WAY.get(tgt.name, 'take it down its own way')}")


def parse_job(job) -> str | None:
    """--job: a Slurm job id, or None for "our latest one"."""
    if job is None:
        return None
    job = str(job).strip()
    # Slurm job ids start at 1 and fit 32 bits (10 digits): int() of 5000 digits would raise ValueError
    if not re.fullmatch(r"[0-9]{1,10}", job) or int(job) == 0:
        shown = repr(job) if len(job) <= 40 else f"a value of {len(job)} characters"
        raise OptionError(f"--job must be a Slurm job id (a number), not {shown}; see `fab status`")
    return job


def parse_host(host) -> str:
    """`fab ssh HOST`: a host name must be given (which hosts exist, the inventory says later)."""
    name = "" if host is None else str(host).strip()
    if not name:  # checked first: the fix does not depend on the cluster
        raise OptionError("name the host to open a shell on: `fab ssh controller` or `fab ssh gpu-node-01` "
                          "(`fab status` lists the GPU nodes)")
    return name


def parse(target=None, stack=None, config=None, nodes=None, gpus_per_node=None, examples=None,
          model=None, data=None, identity=None, skip_check=False, healthy_only=False,
          max_cost=None, down=False, drop_unfinished=False) -> TrainOptions:
    """Check `fab train`'s flags on their own (no inventory needed)."""
    return parse_train(parse_cluster(target=target, stack=stack, identity=identity), config=config,
                       nodes=nodes, gpus_per_node=gpus_per_node, examples=examples, model=model, data=data,
                       skip_check=skip_check, healthy_only=healthy_only, max_cost=max_cost, down=down,
                       drop_unfinished=drop_unfinished)


def parse_check_flags(skip_check, healthy_only) -> tuple[bool, bool]:
    """--skip-check and --healthy-only: the second acts on the check's result, so not with the first."""
    if skip_check and healthy_only:
        raise OptionError("--healthy-only goes on without the nodes the network check fails, and --skip-check "
                          "skips that check: pass one of them (`fab check` runs the check on its own)")
    return bool(skip_check), bool(healthy_only)


def parse_train(where: ClusterOptions, config=None, nodes=None, gpus_per_node=None, examples=None,
                model=None, data=None, skip_check=False, healthy_only=False, max_cost=None,
                down=False, drop_unfinished=False) -> TrainOptions:
    """`fab train`'s own flags, for the cluster `where` names (already checked by `parse_cluster`)."""
    if drop_unfinished and not down:
        raise OptionError("--drop-unfinished lets --down destroy the stack with unfinished runs' checkpoints: "
                          "pass it with --down (or `fab down --drop-unfinished`)")
    if down:  # before the config: the fix does not depend on it
        check_down(where.target, "--down")
    skip_check, healthy_only = parse_check_flags(skip_check, healthy_only)  # before the config (may import TRL)
    from ops.cost import cap as cost_cap

    try:
        cap = cost_cap.parse(max_cost)
    except cost_cap.CostCapError as exc:
        raise OptionError(str(exc)) from None
    tgt, identity = targets.get(where.target), where.identity
    path, settings = _config(config, tgt)
    data_file = local_data_file(data)
    if data_file is not None and not Path(data_file).expanduser().is_file():
        raise OptionError(f"--data {data_file}: no such file on this machine; give a data file that exists here "
                          "(JSONL, JSON, CSV or Parquet), a Hub data set ID or an absolute path on the cluster")
    model = _model_or_data("model", model, tgt)
    data = data_file or _model_or_data("data", data, tgt)
    from training.validate import default

    def from_config(key: str, flag: str) -> str | None:
        value = settings.get(key, default(key))
        where = f"{key} in --config {path.name}" + ("" if key in settings else " (its default)")
        return _model_or_data(flag, value, tgt, label=f"{where}: {flag} location")

    return TrainOptions(
        target=where.target, stack=where.stack, config=path,
        nodes=_int("nodes", nodes), gpus_per_node=_int("gpus-per-node", gpus_per_node),
        examples=_int("examples", examples), model=model, data=data, identity=identity,
        skip_check=skip_check, healthy_only=healthy_only, max_cost=cap, down=bool(down),
        drop_unfinished=bool(drop_unfinished), settings=settings, data_file=data_file,
        config_model=None if model else from_config("model_name_or_path", "model"),
        config_data=None if data else from_config("dataset_name", "data"),
    )


def check_against(opts: TrainOptions, inv: Inventory) -> tuple[int, int]:
    """(nodes, gpus per node) to use, checked against what the cluster has."""
    have_nodes, have_gpus = len(inv.gpu_nodes), inv.gpus_per_node
    nodes = opts.nodes or have_nodes
    gpus = opts.gpus_per_node or have_gpus
    if nodes > have_nodes:
        raise OptionError(f"--nodes {nodes}: the {inv.target} cluster {inv.cluster_name!r} has {have_nodes} "
                          f"GPU node(s); pass --nodes {have_nodes} or fewer, or grow the cluster")
    if gpus > have_gpus:
        raise OptionError(f"--gpus-per-node {gpus}: nodes of {inv.cluster_name!r} have {have_gpus} GPU(s) "
                          f"({inv.gpu_type}); pass --gpus-per-node {have_gpus} or fewer")
    if not opts.identity and inv.ssh_key_file and not Path(inv.ssh_key_file).expanduser().is_file():
        raise OptionError(f"the inventory's SSH key {inv.ssh_key_file} is not on this machine; "
                          "pass --identity KEYFILE")
    return nodes, gpus
