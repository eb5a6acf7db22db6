"""Render every file a cluster node needs from one `ClusterFacts` (Jinja2, StrictUndefined).

The AWS nodes get these files through cloud-init user-data (bootstrap/user_data.py); the
local cluster writes the same `render_files` output and runs the same bootstrap script,
so what the tests exercise is what AWS boots. Where each file goes and what each role
gets: bootstrap/node_layout.py; the versions the nodes install: bootstrap/node_pins.py.

Layout:
  bootstrap/templates/   config files (slurm.conf, gres.conf, hosts, exports,
                         cloud-config) - Jinja2, StrictUndefined
  bootstrap/scripts/     shell scripts (bootstrap per role, health check) -
                         Jinja2 templates of bash, shellchecked in tests
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jinja2

from bootstrap.node_layout import (
    APT_HOLD_CONF,
    APT_LOCK_CONF,
    APT_LOCK_TIMEOUT_S,
    CGROUP_CONF,
    ENV_PROFILE,
    EXPORTS_FILE,
    GRES_CONF,
    HOLD_PREFIXES,
    HOSTS_BEGIN,
    HOSTS_BLOCK_FILE,
    HOSTS_END,
    IMDS_GUARD_RULES,
    IMDS_GUARD_TABLE,
    IMDS_GUARD_UNIT,
    IMDS_GUARD_UNIT_PATH,
    IMDS_GUARD_USERS,
    IMDS_IPV6,
    MARKER_PATH,
    NODE_LOCAL_KEY_MARKER,
    NOT_FOR_ROLE,
    POWER_LOG,
    POWER_PATH,
    POWER_VENV,
    RESUME_PATH,
    SLURM_CONF,
    SLURM_CONF_DIR,
    SLURMCTLD_DROPIN,
    SLURMD_DROPIN,
    SLURMD_ENV_FILE,
    SPOT_WATCH_ENV,
    SPOT_WATCH_PATH,
    SPOT_WATCH_POLL_S,
    SPOT_WATCH_UNIT,
    SPOT_WATCH_UNIT_PATH,
    START_FAILED_MAX,
    START_FAILED_REASON,
    STATE_DIR,
    STEPS,
    STEPS_DIR,
    SUSPEND_PATH,
    TRAINING_VENV,
    VERSION_PATH,
    check_role,
    role_packages,
)
from bootstrap.node_pins import (
    WHEEL_CACHE_DIR,
    WHEEL_DOWNLOAD_TIMEOUT_S,
    WHEEL_MANIFEST,
    WHEEL_POLL_S,
    WHEEL_START_WAIT_S,
    WHEEL_WAIT_S,
    power_pins,
    training_modules,
    training_requirements,
    wheel_cache,
)
from bootstrap.shipped_form import shipped_python
from cluster.facts import DEFAULT_IMDS, JOB_SCRATCH_DIRS, STACK_TAG, ClusterFacts
from cluster.hostpaths import BOOTSTRAP_PATH, HEALTHCHECK_PATH
from cluster.shell_quote import shell_quote
from cluster.targets.local import LOCAL_SKIP_STEPS

HERE = Path(__file__).resolve().parent


def _env(subdir: str, **syntax) -> jinja2.Environment:
    env = jinja2.Environment(
        **syntax,
        loader=jinja2.FileSystemLoader(str(HERE / subdir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["shquote"] = shell_quote
    env.filters["pyrepr"] = repr  # a Python literal (the power programs are Python)
    return env


_TEMPLATES = _env("templates")
# bash's ${#array[@]} would open a Jinja comment: scripts use {## ... ##} instead.
_SCRIPTS = _env("scripts", comment_start_string="{##", comment_end_string="##}")


# The shared /scratch's own EBS volume on the controller (bootstrap `scratchvol` step). On a Nitro
# instance an EBS volume is an NVMe device whose model is "Amazon Elastic Block Store" and whose serial
# is the volume id without its dash; udev links it as <scratch_volume_dir>/nvme-Amazon_Elastic_Block_
# Store_vol<hex> (Amazon EBS User Guide, "Map Amazon EBS volumes to NVMe device names":
# https://docs.aws.amazon.com/ebs/latest/userguide/identify-nvme-ebs-device.html; systemd's
# 60-persistent-storage.rules "nvme-$env{ID_MODEL}_$env{ID_SERIAL_SHORT}"). The step takes the one such
# disk that nothing is mounted from (the root disk has / on it), not a volume id: user-data is kept from
# the first `pulumi up` (infra/nodes.py IGNORED_ON_UPDATE) and a replaced volume has a new id.
EBS_LINK_PREFIX = "nvme-Amazon_Elastic_Block_Store_vol"
# The volume is attached only once the instance runs (infra/nodes.py): the step waits this long.
SCRATCH_VOLUME_WAIT_S = 600
# nfs-server starts only once /scratch is mounted: it never exports the root file system's folder.
# nfs-server.service is nfs-utils' own unit name; Debian/Ubuntu's nfs-kernel-server.service (what the
# `nfs` step enables) is an alias of it, and a drop-in under the unit's name applies whichever name
# starts it (systemd.unit(5), "drop-in" directories).
SCRATCH_NFS_DROPIN = "/etc/systemd/system/nfs-server.service.d/slurm-gpu-scratch.conf"



def _context(facts: ClusterFacts) -> dict:
    shape = facts.shape
    if shape.gpu_count < 1:
        raise ValueError(f"gpu_count must be >= 1 (got {shape.gpu_count})")
    if shape.cpus < 1 or shape.real_memory_mib < 1:
        raise ValueError("NodeShape cpus and real_memory_mib must be positive")
    shape.check()
    if facts.slurmd_timeout < 1 or facts.cred_expire < 5:  # Slurm ignores cred_expire < 5
        raise ValueError("slurmd_timeout must be >= 1 and cred_expire >= 5 seconds")
    if facts.health_check_interval < 1 or (facts.sched_interval is not None and facts.sched_interval < 1):
        raise ValueError("health_check_interval and sched_interval must be >= 1 second")
    _check_power_save(facts)
    if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", facts.job_user) or facts.job_uid < 0 or \
            (facts.job_user == "root") != (facts.job_uid == 0):
        raise ValueError(f"job_user {facts.job_user!r} (uid {facts.job_uid}) is not a user name the "
                         "bootstrap can make: lower-case letters, digits, _ and -; root only with uid 0")
    last = shape.gpu_count - 1
    prefix = facts.gpu_device_prefix
    gpu_files = f"{prefix}0" if last == 0 else f"{prefix}[0-{last}]"
    return {
        "facts": facts,
        "job_scratch_dirs": JOB_SCRATCH_DIRS,
        "platform": facts.platform,
        "cluster_name": facts.cluster_name,
        "spot": facts.spot,
        "spot_imds": facts.spot_imds,
        "spot_watch_unit": SPOT_WATCH_UNIT,
        "controller": facts.controller,
        "gpu_nodes": facts.gpu_nodes,
        "shape": shape,
        "gres": f"gpu:{shape.gpu_type}:{shape.gpu_count}",
        "gpu_files": gpu_files,
        "gpu_devices": [f"{prefix}{i}" for i in range(shape.gpu_count)],
        # Memory per CPU for jobs that do not ask (keeps small jobs sharing a node).
        "def_mem_per_cpu": max(1, shape.real_memory_mib // shape.cpus),
        "scratch": facts.scratch.rstrip("/") or "/",
        # What a GPU node mounts on /scratch (the controller's NFS export on AWS).
        "scratch_source": facts.platform.scratch_source.format(
            controller_ip=facts.controller.ip, scratch=facts.scratch.rstrip("/") or "/"),
        "subnet_cidr": facts.subnet_cidr,
        "ebs_link_prefix": EBS_LINK_PREFIX,
        "scratch_volume_wait_s": SCRATCH_VOLUME_WAIT_S,
        "scratch_dropin": SCRATCH_NFS_DROPIN,
        "paths": {
            "slurm_conf": SLURM_CONF,
            "gres_conf": GRES_CONF,
            "cgroup_conf": CGROUP_CONF,
            "exports": EXPORTS_FILE,
            "hosts_block": HOSTS_BLOCK_FILE,
            "slurmd_env": SLURMD_ENV_FILE,
            "slurmd_dropin": SLURMD_DROPIN,
            "healthcheck": HEALTHCHECK_PATH,
            "bootstrap": BOOTSTRAP_PATH,
            "env_profile": ENV_PROFILE,
            "venv": TRAINING_VENV,
            "state_dir": STATE_DIR,
            "marker": MARKER_PATH,
            "version": VERSION_PATH,
            "node_local_key": NODE_LOCAL_KEY_MARKER,
            "apt_lock_conf": APT_LOCK_CONF,
            "apt_hold_conf": APT_HOLD_CONF,
            "steps_dir": STEPS_DIR,
            "suspend": SUSPEND_PATH,
            "resume": RESUME_PATH,
            "power": POWER_PATH,
            "power_log": POWER_LOG,
            "power_venv": POWER_VENV,
            "power_python": f"{POWER_VENV}/bin/python3",
        },
        "start_failed_prefix": START_FAILED_REASON,
        "start_failed_max": START_FAILED_MAX,
        "power": facts.power_save,
        "stack_tag": STACK_TAG,
        "power_pins": power_pins(),
        "ec2_power": facts.power_save is not None and facts.power_save.provider == "ec2",
        "hosts_begin": HOSTS_BEGIN,
        "hosts_end": HOSTS_END,
        "apt_lock_timeout_s": APT_LOCK_TIMEOUT_S,
        "hold_prefixes": HOLD_PREFIXES,
    }


POWER_PROVIDERS = ("ec2", "local")


def _check_power_save(facts: ClusterFacts) -> None:
    ps = facts.power_save
    if ps is None:
        return
    if ps.provider not in POWER_PROVIDERS:
        raise ValueError(f"power_save.provider must be one of {', '.join(POWER_PROVIDERS)} (got {ps.provider!r})")
    if ps.suspend_time < 1 or ps.suspend_timeout < 1 or ps.resume_timeout < 1:
        raise ValueError("power_save suspend_time, suspend_timeout and resume_timeout must be >= 1 second")
    if ps.interval is not None and ps.interval < 1:
        raise ValueError("power_save.interval must be >= 1 second")
    for prog in (ps.suspend_program, ps.resume_program):
        if not prog.startswith("/"):
            raise ValueError(f"power-save program {prog!r} must be an absolute path (slurmctld refuses others)")


def render_power_program(facts: ClusterFacts, action: str | None = None) -> str:
    """The EC2 power program (None) or Slurm's SuspendProgram ("suspend") / ResumeProgram
    ("resume"): a wrapper that runs it, from the controller's power venv, for that action."""
    if action is None:
        return _SCRIPTS.get_template("power-ec2.py.j2").render(**_context(facts))
    if action not in ("suspend", "resume"):
        raise ValueError(f"action must be suspend or resume (got {action!r})")
    return _SCRIPTS.get_template("power-wrapper.sh.j2").render(action=action, **_context(facts))


def render_slurm_conf(facts: ClusterFacts) -> str:
    return _TEMPLATES.get_template("slurm.conf.j2").render(**_context(facts))


def render_gres_conf(facts: ClusterFacts) -> str:
    return _TEMPLATES.get_template("gres.conf.j2").render(**_context(facts))


def render_cgroup_conf(facts: ClusterFacts) -> str:
    return _TEMPLATES.get_template("cgroup.conf.j2").render(**_context(facts))


def render_hosts(facts: ClusterFacts) -> str:
    """The cluster's "IP name" lines between begin/end markers (see `merge_hosts`)."""
    return _TEMPLATES.get_template("hosts.j2").render(**_context(facts))


def merge_hosts(existing: str, block: str) -> str:
    """/etc/hosts text with `block` replacing any earlier slurm-gpu block (idempotent)."""
    pattern = re.compile(
        rf"^{re.escape(HOSTS_BEGIN)}.*?^{re.escape(HOSTS_END)}[^\n]*\n?", re.S | re.M
    )
    kept = pattern.sub("", existing)
    if kept and not kept.endswith("\n"):
        kept += "\n"
    return kept + block


def render_exports(facts: ClusterFacts) -> str:
    return _TEMPLATES.get_template("exports.j2").render(**_context(facts))


def render_healthcheck(facts: ClusterFacts) -> str:
    return _SCRIPTS.get_template("healthcheck.sh.j2").render(**_context(facts))


def render_slurmd_env(facts: ClusterFacts) -> str:
    return _TEMPLATES.get_template("slurmd.env.j2").render(**_context(facts))


def render_slurmd_dropin(facts: ClusterFacts) -> str:
    return _TEMPLATES.get_template("slurmd-dropin.conf.j2").render(**_context(facts))


def render_spot_watch(facts: ClusterFacts) -> dict[str, str]:
    """The watcher program, its systemd unit and its settings (a spot GPU node's files)."""
    if not re.fullmatch(r"http://[A-Za-z0-9.\-\[\]:]+", facts.spot_imds):
        raise ValueError(f"spot_imds must be http://HOST[:PORT] (got {facts.spot_imds!r})")
    ctx = {**_context(facts), "watch_path": SPOT_WATCH_PATH, "env_file": SPOT_WATCH_ENV,
           "poll_s": SPOT_WATCH_POLL_S}
    return {
        SPOT_WATCH_PATH: shipped_python((Path(__file__).parent / "spot_watch.py").read_text()),
        SPOT_WATCH_UNIT_PATH: _TEMPLATES.get_template("spot-watch.service.j2").render(**ctx),
        SPOT_WATCH_ENV: _TEMPLATES.get_template("spot-watch.env.j2").render(**ctx),
    }



def imds_address(facts: ClusterFacts) -> tuple[str, int]:
    """(IPv4 address, port) of the metadata service the hosts ask (`facts.spot_imds`)."""
    m = re.fullmatch(r"http://(\d{1,3}(?:\.\d{1,3}){3})(?::(\d{1,5}))?/?", facts.spot_imds)
    if not m:
        raise ValueError(f"spot_imds must be http://IPV4[:PORT] for the controller's metadata guard "
                         f"(got {facts.spot_imds!r})")
    return m[1], int(m[2] or 80)


def render_imds_guard(facts: ClusterFacts) -> dict[str, str]:
    """The controller's metadata guard: its nftables rules, the unit that loads them at boot, and
    slurmctld's drop-in that requires that unit."""
    host, port = imds_address(facts)
    guard = {"unit": IMDS_GUARD_UNIT, "rules": IMDS_GUARD_RULES, "table": IMDS_GUARD_TABLE,
             "users": IMDS_GUARD_USERS, "host": host, "port": port, "slurmctld_dropin": SLURMCTLD_DROPIN,
             "host6": IMDS_IPV6 if f"http://{host}" == DEFAULT_IMDS else None}
    ctx = {**_context(facts), "imds_guard": guard}
    return {
        IMDS_GUARD_RULES: _TEMPLATES.get_template("imds-guard.nft.j2").render(**ctx),
        IMDS_GUARD_UNIT_PATH: _TEMPLATES.get_template("imds-guard.service.j2").render(**ctx),
        SLURMCTLD_DROPIN: _TEMPLATES.get_template("slurmctld-dropin.conf.j2").render(**ctx),
    }


def render_apt_lock_conf(facts: ClusterFacts) -> str:
    """apt's wait for the dpkg lock (the bootstrap's apt-get, and any apt run on the node)."""
    return _TEMPLATES.get_template("apt-lock-wait.conf.j2").render(**_context(facts))


def render_files(facts: ClusterFacts) -> dict[str, str]:
    """Absolute path on a node -> file text, for every file bootstrap installs.

    Modes: FILE_MODES (executables), everything else 0644, owned by root.
    """
    files = {
        SLURM_CONF: render_slurm_conf(facts),
        GRES_CONF: render_gres_conf(facts),
        EXPORTS_FILE: render_exports(facts),
        HOSTS_BLOCK_FILE: render_hosts(facts),
        HEALTHCHECK_PATH: render_healthcheck(facts),
        SLURMD_ENV_FILE: render_slurmd_env(facts),
        SLURMD_DROPIN: render_slurmd_dropin(facts),
    }
    if facts.platform.cgroup:
        files[CGROUP_CONF] = render_cgroup_conf(facts)
    if facts.spot:
        files.update(render_spot_watch(facts))
    files.update(render_imds_guard(facts))
    if facts.power_save is not None and facts.power_save.provider == "ec2":
        files[POWER_PATH] = render_power_program(facts)
        files[SUSPEND_PATH] = render_power_program(facts, "suspend")
        files[RESUME_PATH] = render_power_program(facts, "resume")
    return files



def node_facts(facts: ClusterFacts, hostname: str) -> ClusterFacts:
    """The facts one GPU node's files are made from: the controller and that node only,
    so its user-data stays the same when other nodes are added or removed."""
    host = next((h for h in facts.gpu_nodes if h.name == hostname), None)
    if host is None:
        raise ValueError(f"{hostname!r} is not a gpu host of cluster {facts.cluster_name!r}")
    return dataclasses.replace(facts, gpu_nodes=(host,))


def role_files(facts: ClusterFacts, role: str) -> dict[str, str]:
    """The subset of `render_files` a role needs (see NOT_FOR_ROLE). GPU nodes get nothing
    under /etc/slurm/ (slurm.conf, gres.conf, cgroup.conf...): slurmd fetches those."""
    check_role(role)
    files = render_files(facts)
    for path in NOT_FOR_ROLE[role]:
        files.pop(path, None)
    if role == "gpu":
        files = {p: t for p, t in files.items() if not p.startswith(SLURM_CONF_DIR)}
    return files


def render_bootstrap_script(facts: ClusterFacts, role: str, hostname: str | None, version: str) -> str:
    """The role's bootstrap script (bash). `hostname`: the name to take; None: the
    cluster host whose IP this machine has (see the script's `hostname` step). A GPU node
    given by name gets the script made from `node_facts`, as in its user-data. `version`:
    what the script records when it finishes (bootstrap/user_data.py's `bootstrap_version`)."""
    check_role(role)
    if role == "gpu" and hostname is not None:
        facts = node_facts(facts, hostname)
    ctx = _context(facts)
    ctx["role"] = role
    ctx["hostname"] = hostname or ""
    ctx["bootstrap_version"] = version
    ctx["steps"] = STEPS[role]
    ctx["pinned_requirements"] = training_requirements(facts.platform)
    ctx["training_modules"] = training_modules()
    ctx["wheel_cache"] = wheel_cache(facts, ctx["pinned_requirements"])
    ctx["wheel_cache_dir"] = WHEEL_CACHE_DIR
    ctx["wheel_manifest"] = WHEEL_MANIFEST
    ctx["wheel"] = {"wait_s": WHEEL_WAIT_S, "start_wait_s": WHEEL_START_WAIT_S, "poll_s": WHEEL_POLL_S,
                    "download_timeout_s": WHEEL_DOWNLOAD_TIMEOUT_S}
    ctx["packages"] = role_packages(facts.platform, role)
    ctx["local_skip"] = LOCAL_SKIP_STEPS[role]
    ctx.update(imds_guard_unit=IMDS_GUARD_UNIT, imds_guard_rules=IMDS_GUARD_RULES, imds_guard_table=IMDS_GUARD_TABLE)
    return _SCRIPTS.get_template(f"bootstrap-{role}.sh.j2").render(**ctx)


def render_cloud_config(facts: ClusterFacts, role: str, files: list[dict]) -> str:
    """The #cloud-config of a node of `role` that writes `files` (path, permissions, content each)."""
    ctx = _context(facts)
    ctx.update(role=role, packages=role_packages(facts.platform, role))
    return _TEMPLATES.get_template("cloud-config.yaml.j2").render(files=files, **ctx)
