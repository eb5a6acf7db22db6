"""Render every file a cluster node needs from one `ClusterFacts`.

The AWS nodes get these files through cloud-init user-data (`user_data`); the
local cluster writes the same `render_files` output and runs the same
`bootstrap_script`, so what the tests exercise is what AWS boots.

Layout:
  bootstrap/templates/   config files (slurm.conf, gres.conf, hosts, exports,
                         cloud-config) - Jinja2, StrictUndefined
  bootstrap/scripts/     shell scripts (bootstrap per role, health check) -
                         Jinja2 templates of bash, shellchecked in tests
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import gzip
import hashlib
import re
from pathlib import Path

import jinja2

from cluster.facts import DEFAULT_IMDS, STACK_TAG, ClusterFacts
from cluster.hostpaths import BOOTSTRAP_PATH, HEALTHCHECK_PATH
from cluster.platform import Platform
from cluster.targets.local import LOCAL_SKIP_STEPS

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
REQUIREMENTS = REPO / "requirements.txt"

ROLES = ("controller", "gpu")

# Where things live on a node; other parts (inventory, local cluster, fab) import these.
SLURM_CONF_DIR = "/etc/slurm/"  # configless: slurmctld serves every file here to the GPU nodes
SLURM_CONF = "/etc/slurm/slurm.conf"
GRES_CONF = "/etc/slurm/gres.conf"
# Only where the platform has cgroups (cluster/platform.py); slurmctld serves it to the nodes.
CGROUP_CONF = "/etc/slurm/cgroup.conf"
EXPORTS_FILE = "/etc/exports.d/slurm-gpu.exports"
HOSTS_BLOCK_FILE = "/etc/slurm-gpu/hosts.block"
# Configless GPU nodes: slurmd's options (--conf-server) and the systemd drop-in that reads them.
SLURMD_ENV_FILE = "/etc/slurm-gpu/slurmd.env"
SLURMD_DROPIN = "/etc/systemd/system/slurmd.service.d/slurm-gpu.conf"
# Spot GPU nodes: the interruption watcher (bootstrap/spot_watch.py), its unit and its settings.
SPOT_WATCH_PATH = "/usr/local/sbin/slurm-gpu-spot-watch"
SPOT_WATCH_UNIT = "slurm-gpu-spot-watch.service"
SPOT_WATCH_UNIT_PATH = f"/etc/systemd/system/{SPOT_WATCH_UNIT}"
SPOT_WATCH_ENV = "/etc/slurm-gpu/spot-watch.env"
SPOT_WATCH_POLL_S = 5  # AWS recommends checking for interruption notices every 5 seconds
# The controller's instance metadata guard (its `imds` step): an nftables table that resets every
# connection to the metadata service but root's and SlurmUser's (the power programs'), loaded at every
# boot by its own unit. nftables, not iptables: one rule file replaced atomically, matched on the
# socket's owner (`meta skuid`); Ubuntu 24.04's archive has nftables 1.0.9 and Debian 12's 1.0.6
# (Priority: important there), and Ubuntu's iptables is itself the nf_tables backend. Whether or not
# the image has it, the controller's `packages` step installs it (PACKAGES).
IMDS_GUARD_UNIT = "slurm-gpu-imds-guard.service"
IMDS_GUARD_UNIT_PATH = f"/etc/systemd/system/{IMDS_GUARD_UNIT}"
IMDS_GUARD_RULES = "/etc/slurm-gpu/imds-guard.nft"
IMDS_GUARD_TABLE = "slurm_gpu_imds"
IMDS_GUARD_USERS = ("root", "slurm")  # slurm: slurm.conf's SlurmUser, who runs the power programs
# slurmctld's drop-in: Requires= and After= the guard's unit (fails closed: no guard, no slurmctld).
SLURMCTLD_DROPIN = "/etc/systemd/system/slurmctld.service.d/slurm-gpu-imds-guard.conf"
# The metadata service's IPv6 address on Nitro instances (EC2 User Guide, "Access instance metadata":
# [fd00:ec2::254], when its IPv6 endpoint is on): guarded too, with the IPv4 one.
IMDS_IPV6 = "fd00:ec2::254"
# Slurm's SuspendProgram/ResumeProgram on AWS (run by slurmctld as SlurmUser) and their log.
SUSPEND_PATH = "/usr/local/sbin/slurm-gpu-suspend"
RESUME_PATH = "/usr/local/sbin/slurm-gpu-resume"
# Both are two-line wrappers of this one program (`slurm-gpu-power suspend|resume HOSTLIST`).
POWER_PATH = "/usr/local/sbin/slurm-gpu-power"
# `slurm-gpu-power start-failed HOSTLIST CODE MESSAGE` (the local cluster's programs run it too) tells
# Slurm at once of nodes that did not start: power_down_force with the reason "start failed: CODE:
# MESSAGE" (one line, at most START_FAILED_MAX characters), which fab reads (ops/actions/node_power.py).
START_FAILED_REASON = "start failed:"
START_FAILED_MAX = 200
POWER_LOG = "/var/log/slurm/slurm-gpu-power.log"
# The controller's own venv for those programs: boto3 (POWER_PACKAGES, pinned in requirements.txt),
# made by the controller bootstrap's `power` step. Slurm runs the programs with no PATH: their
# first line names this interpreter.
POWER_VENV = "/opt/slurm-gpu/power"
POWER_PACKAGES = ("boto3", "botocore")
ENV_PROFILE = "/etc/profile.d/slurm-gpu.sh"
TRAINING_VENV = "/opt/slurm-gpu/venv"
TRAINING_PYTHON = f"{TRAINING_VENV}/bin/python"
# Per-host state (under /var/lib/slurm, which the local cluster gives each host).
STATE_DIR = "/var/lib/slurm/slurm-gpu"
MARKER_PATH = f"{STATE_DIR}/bootstrap.done"
# The version of the bootstrap a node last ran to the end (`bootstrap_version`): `fab status` names
# nodes whose version differs from what this checkout renders, `fab update-nodes` brings them up.
VERSION_PATH = f"{STATE_DIR}/bootstrap.version"
# Present while a GPU node holds the munge key it made for itself at first boot: slurmd's
# drop-in does not start slurmd while it exists (a configless slurmd cannot fetch its config with
# a key the controller does not share; Slurm 23.11 then exits for good). fab's key sync
# (ops/actions/munge.py) installs the cluster's key, removes it, and starts slurmd.
NODE_LOCAL_KEY_MARKER = f"{STATE_DIR}/munge-key.node-local"
# apt on the node waits this long for a dpkg lock held by another apt (first-boot unattended
# upgrades): the bootstrap's `packages` step installs every package, not cloud-init's package
# module, which gives up after 30 s before apt-get even runs (APT_LOCK_WAIT_TIMEOUT in cloud-init's
# cloudinit/distros/package_management/apt.py), so no apt.conf setting can extend its wait.
APT_LOCK_CONF = "/etc/apt/apt.conf.d/90slurm-gpu-lock-wait"
APT_LOCK_TIMEOUT_S = 900
# Where real_gpus: the image's kernel and NVIDIA packages stay as it shipped them (the GPU
# bootstrap's `holds` step: apt-mark hold of the installed ones, and unattended-upgrades'
# Package-Blacklist for these prefixes). A newer image is the way to newer ones (docs/PLATFORM.md).
HOLD_PREFIXES = ("linux-image", "linux-headers", "linux-modules", "linux-aws", "nvidia", "libnvidia")
APT_HOLD_CONF = "/etc/apt/apt.conf.d/51slurm-gpu-hold-gpu-stack"
# Each bootstrap step's record: <step>.status ("running|ok|skipped|failed ... <UTC time>") and
# <step>.log (its output); ops/actions/cloudinit.py reads them to name a failed step.
STEPS_DIR = f"{STATE_DIR}/bootstrap"
HOSTS_BEGIN = "# BEGIN slurm-gpu hosts"
HOSTS_END = "# END slurm-gpu hosts"

# EC2 refuses user-data over 16 KiB (raw, before base64).
MAX_USER_DATA_BYTES = 16384

# Mode of each rendered file (default 0644).
FILE_MODES = {HEALTHCHECK_PATH: 0o755, BOOTSTRAP_PATH: 0o755, SUSPEND_PATH: 0o755, RESUME_PATH: 0o755,
              POWER_PATH: 0o755, SPOT_WATCH_PATH: 0o755}


# The training stack on GPU nodes: pinned to the same versions as the repo's
# requirements.txt (the one place versions live). torch from the default index
# is a CUDA build on Linux x86_64, which is what GPU nodes need.
TRAINING_PACKAGES = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "tensorboardx")
# The module each imports where it is not the package's name (the `training` step imports them all).
IMPORT_NAMES = {"tensorboardx": "tensorboardX"}


def training_modules() -> list[str]:
    return [IMPORT_NAMES.get(name, name) for name in TRAINING_PACKAGES]

# The GPU nodes' wheel cache on the shared scratch (the controller's `wheels` step fills it,
# their `training` step installs from it): one directory per pin set, Python and wheel tags.
WHEEL_CACHE_DIR = "wheels"
# In each cache: every wheel as `name==version --hash=sha256:...`, written by the controller as it
# fills the cache; a node installs `--require-hashes -r` it, so a changed or added wheel is refused.
WHEEL_MANIFEST = "requirements-hashed.txt"
# How long a GPU node waits for the cache before it installs from the index instead: in all,
# and for the controller to have started it at all (a controller whose bootstrap predates the
# pins never will). The controller's download is bounded too.
WHEEL_WAIT_S = 900
WHEEL_START_WAIT_S = 180
WHEEL_POLL_S = 5
WHEEL_DOWNLOAD_TIMEOUT_S = 1800

# Debian/Ubuntu packages per role (the bootstrap's `packages` step installs them).
PACKAGES = {
    # python3-pip: the `wheels` step downloads the GPU nodes' training stack; python3-venv: the
    # power-save programs' boto3 venv (POWER_VENV).
    # nftables: the `imds` step's metadata guard (IMDS_GUARD_RULES).
    "controller": ("slurm-wlm", "munge", "nfs-common", "nfs-kernel-server", "python3-pip",
                   "python3-venv", "nftables"),
    # python3-dev and a C compiler: Triton (torch.compile, flex attention) builds C against
    # Python.h at run time.
    "gpu": ("slurm-wlm", "munge", "nfs-common", "python3-venv", "python3-pip", "python3-dev",
            "build-essential"),
}


def role_packages(platform: Platform, role: str) -> tuple[str, ...]:
    """The apt packages a role's node installs: PACKAGES, and on a GPU node of a platform that
    takes torch from the OS (`Platform.os_torch`) that package too."""
    _check_role(role)
    extra = (platform.os_torch.package,) if role == "gpu" and platform.os_torch else ()
    return PACKAGES[role] + extra


# Steps of each role's bootstrap script, in order (SLURM_GPU_SKIP_STEPS picks from these).
STEPS = {
    # scratchvol before nfs: nfs-server exports /scratch's own volume, never the folder under it.
    "controller": ("hostname", "hosts", "packages", "dirs", "munge", "scratchvol", "nfs", "scratch", "power", "imds",
                   "wheels", "services"),
    "gpu": (
        "hostname", "hosts", "holds", "packages", "dirs", "munge", "healthcheck", "nfs", "scratch",
        "training", "gpus", "services",
    ),
}


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
    env.filters["shquote"] = _shquote
    env.filters["pyrepr"] = repr  # a Python literal (the power programs are Python)
    return env


def _shquote(value) -> str:
    """Single-quote for bash (values come from validated facts; quote anyway)."""
    return "'" + str(value).replace("'", "'\"'\"'") + "'"


_TEMPLATES = _env("templates")
# bash's ${#array[@]} would open a Jinja comment: scripts use {## ... ##} instead.
_SCRIPTS = _env("scripts", comment_start_string="{##", comment_end_string="##}")


# The shared /scratch's own EBS volume on the controller (bootstrap `scratchvol` step). Its id:
# "vol-" and 17 hex digits (8 for old volumes) (EC2 API Reference, Volume). On a Nitro instance an
# EBS volume is an NVMe device whose serial number is the volume id without its dash, and udev links
# it as <scratch_volume_dir>/nvme-Amazon_Elastic_Block_Store_vol<hex> (Amazon EBS User Guide, "Amazon
# EBS volumes and NVMe" / "Map Amazon EBS volumes to NVMe device names":
# https://docs.aws.amazon.com/ebs/latest/userguide/identify-nvme-ebs-device.html; the by-id name is
# systemd's 60-persistent-storage.rules "nvme-$attr{model}_$attr{serial}").
VOLUME_ID_RE = re.compile(r"^vol-([0-9a-f]{8}|[0-9a-f]{17})$")
# What the plan-time size check renders in place of the id, which exists only once the volume is made
# (infra/program.py render_user_data): as long as a real one.
PLACEHOLDER_VOLUME_ID = "vol-00000000000000000"
# The volume is attached only once the instance runs (infra/nodes.py): the step waits this long.
SCRATCH_VOLUME_WAIT_S = 600
# nfs-server starts only once /scratch is mounted: it never exports the root file system's folder.
# nfs-server.service is nfs-utils' own unit name; Debian/Ubuntu's nfs-kernel-server.service (what the
# `nfs` step enables) is an alias of it, and a drop-in under the unit's name applies whichever name
# starts it (systemd.unit(5), "drop-in" directories).
SCRATCH_NFS_DROPIN = "/etc/systemd/system/nfs-server.service.d/slurm-gpu-scratch.conf"


def scratch_device(facts: ClusterFacts) -> str | None:
    """The by-id path of the controller's /scratch volume; None where the platform has no EBS or the
    id is not given (then the step refuses to run: /scratch is never left on the root file system)."""
    vid = facts.scratch_volume_id
    if facts.platform.scratch_volume_dir is None or vid is None:
        return None
    if not VOLUME_ID_RE.match(vid):
        raise ValueError(f"scratch_volume_id must be an EBS volume id (vol- and 8 or 17 hex digits) on "
                         f"platform {facts.platform.name} (got {vid!r})")
    return f"{facts.platform.scratch_volume_dir.rstrip('/')}/nvme-Amazon_Elastic_Block_Store_{vid.replace('-', '')}"


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
    last = shape.gpu_count - 1
    prefix = facts.gpu_device_prefix
    gpu_files = f"{prefix}0" if last == 0 else f"{prefix}[0-{last}]"
    return {
        "facts": facts,
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
        "scratch_device": scratch_device(facts),
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


def shipped_python(source: str) -> str:
    """A Python program as user-data carries it: the same code without its docstrings and comments
    (`ast.unparse` of the parsed module, docstrings dropped), which EC2's 16 KiB would otherwise pay
    for (the spot watcher: 13 KB of text, 4.7 KB gzip-compressed; 2.8 KB without them). The `#!` line
    is kept. The source in the repository is the documented one."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    shebang = source.splitlines()[0] + "\n" if source.startswith("#!") else ""
    return shebang + ast.unparse(tree) + "\n"


# A here-document's start after `<<` (`<<WORD`, `<<-WORD`, `<<'WORD'`, `<<"WO-RD"`): bash(1)
# "Here Documents": the delimiter is a word; a quoted one is taken literally.
_HEREDOC = re.compile(r"<<(-?)[ \t]*(?:'([^'\n]+)'|\"([^\"\\$`\n]+)\"|([^\s'\"<>|&;()`$\\]+))")


class UnsafeShell(RuntimeError):
    """shipped_shell met a construct it cannot strip comments from safely: a bootstrap script's bug."""


def _scan_code(line: str, quote: str | None, where: str) -> tuple[str | None, list[tuple[str, bool]], bool]:
    """One line of bash outside a here-document body: the quote still open at its end (None, ' or "),
    the here-documents it starts (delimiter, strip tabs), and whether it ends with a `\\` continuation.
    A `#` that begins a word outside quotes ends the line (bash(1), COMMENTS)."""
    docs: list[tuple[str, bool]] = []
    i, text = 0, line.rstrip("\n")
    while i < len(text):
        c = text[i]
        if quote == "'":
            quote = None if c == "'" else quote
        elif quote == '"':
            if c == "\\":
                i += 1
            elif c == '"':
                quote = None
        elif c == "\\":
            i += 1
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1] in " \t;&|()"):
            return None, docs, False
        elif text.startswith("<<<", i):
            i += 2
        elif text.startswith("<<", i):
            m = _HEREDOC.match(text, i)
            if not m:
                raise UnsafeShell(f"{where}: a `<<` shipped_shell cannot parse: {text.strip()!r}")
            docs.append((m.group(2) or m.group(3) or m.group(4), m.group(1) == "-"))
            i = m.end() - 1
        i += 1
    continued = quote is None and (len(text) - len(text.rstrip("\\"))) % 2 == 1
    return quote, docs, continued


def shipped_shell(script: str, where: str = "script") -> str:
    """A bash script as user-data carries it: without its whole comment lines (the `#!` line kept, and
    every line of a here-document or a multi-line quoted string, whose text is data). bash ignores
    them (bash(1), COMMENTS); a test checks that bash parses both to the same commands (`declare -f`).
    The comments are for the repository's reader and cost EC2's 16 KiB about 2.6 KB gzip-compressed
    on a GPU node. Anything it cannot strip safely raises UnsafeShell (the render fails) rather than
    change the script: a comment line after a `\\` continuation (dropping it would join two commands),
    a `<<` it cannot parse, a here-document or a quote left open at the end."""
    out: list[str] = []
    pending: list[tuple[str, bool]] = []  # here-documents whose bodies come next, in order
    quote, continued = None, False
    for n, line in enumerate(script.splitlines(keepends=True)):
        if pending:  # a here-document's body: data, kept as is
            out.append(line)
            end, strip_tabs = pending[0]
            if (line.lstrip("\t") if strip_tabs else line).rstrip("\n") == end:
                pending.pop(0)
            continue
        if n and quote is None and line.lstrip().startswith("#"):
            if continued:
                raise UnsafeShell(f"{where}: a comment line after a `\\` continuation (line {n + 1}): "
                                  "dropping it would join two commands; move the comment")
            continue
        quote, docs, continued = _scan_code(line, quote, where)
        pending.extend(docs)
        out.append(line)
    if pending or quote:
        raise UnsafeShell(f"{where}: " + (f"here-document {pending[0][0]!r} never ends" if pending
                                          else f"a {quote} quote never closes"))
    return "".join(out)


def shipped(files: dict[str, str]) -> dict[str, str]:
    """Path -> text as user-data carries them: bash scripts without their comments (shipped_shell), the
    power program without its comments and docstrings (shipped_python). fab's copies (`fab update-nodes`)
    and the version hash (bootstrap_version) keep the comments."""
    def one(path: str, text: str) -> str:
        if text.startswith("#!/bin/bash\n"):
            return shipped_shell(text, path)
        return shipped_python(text) if path == POWER_PATH else text

    return {path: one(path, text) for path, text in files.items()}


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


# What each role does not get. GPU nodes run slurmd in configless mode: slurm.conf and
# gres.conf come from slurmctld at start, so no GPU node file depends on the node list.
NOT_FOR_ROLE = {
    "controller": (HEALTHCHECK_PATH, SLURMD_ENV_FILE, SLURMD_DROPIN, SPOT_WATCH_PATH, SPOT_WATCH_UNIT_PATH,
                   SPOT_WATCH_ENV),
    # slurmctld runs the power programs: only the controller has them.
    # GPU nodes have no instance role (infra/nodes.py): no credentials in their metadata to guard.
    "gpu": (EXPORTS_FILE, SLURM_CONF, GRES_CONF, CGROUP_CONF, SUSPEND_PATH, RESUME_PATH, POWER_PATH,
            IMDS_GUARD_RULES, IMDS_GUARD_UNIT_PATH, SLURMCTLD_DROPIN),
}


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
    _check_role(role)
    files = render_files(facts)
    for path in NOT_FOR_ROLE[role]:
        files.pop(path, None)
    if role == "gpu":
        files = {p: t for p, t in files.items() if not p.startswith(SLURM_CONF_DIR)}
    return files


def training_pins(requirements: Path = REQUIREMENTS) -> dict[str, str]:
    """name -> version of the training stack, read from requirements.txt."""
    return _pins(TRAINING_PACKAGES, requirements, "the GPU nodes install the same versions")


def power_pins(requirements: Path = REQUIREMENTS) -> list[str]:
    """["boto3==X", ...]: what the controller's power venv installs, from requirements.txt."""
    pins = _pins(POWER_PACKAGES, requirements, "the controller's power-save programs install them")
    return [f"{name}=={pins[name]}" for name in POWER_PACKAGES]


def _pins(names: tuple[str, ...], requirements: Path, why: str) -> dict[str, str]:
    pins = {}
    for line in requirements.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s#;]+)", line)
        if m and m.group(1).lower() in names:
            pins[m.group(1).lower()] = m.group(2)
    missing = [p for p in names if p not in pins]
    if missing:
        raise ValueError(f"{requirements}: no '==' pin for {', '.join(missing)}; pin them there ({why})")
    return pins


def training_requirements(platform: Platform) -> list[str]:
    """What a GPU node's `training` step installs, "name==version" in TRAINING_PACKAGES order:
    requirements.txt's pins, torch's replaced by the OS package's version where the platform
    takes torch from the OS (the venv then sees the system's site-packages)."""
    pins = training_pins()
    if platform.os_torch:
        pins["torch"] = platform.os_torch.version
    return [f"{name}=={pins[name]}" for name in TRAINING_PACKAGES]


def wheel_cache(facts: ClusterFacts, requirements: list[str]) -> str | None:
    """The wheel cache directory on the shared scratch for these pins on the facts' platform;
    None where the platform's torch is an OS package (`Platform.os_torch`): pip download cannot
    resolve the other pins without a torch wheel, so the nodes install from the index."""
    if facts.platform.os_torch:
        return None
    made_of = "\n".join([facts.platform.python, *facts.platform.wheel_platforms, *requirements])
    scratch = facts.scratch.rstrip("/")
    return f"{scratch}/{WHEEL_CACHE_DIR}/py{facts.platform.python}-{hashlib.sha256(made_of.encode()).hexdigest()[:12]}"


def bootstrap_script(facts: ClusterFacts, role: str, hostname: str | None = None,
                     version: str | None = None) -> str:
    """The role's bootstrap script (bash). `hostname`: the name to take; None: the
    cluster host whose IP this machine has (see the script's `hostname` step). A GPU node
    given by name gets the script made from `node_facts`, as in its user-data. `version`:
    what the script records when it finishes (None: `bootstrap_version`)."""
    _check_role(role)
    if role == "gpu" and hostname is not None:
        facts = node_facts(facts, hostname)
    if version is None:
        version = bootstrap_version(facts, role, hostname)
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


def _bundle(facts: ClusterFacts, role: str, hostname: str | None, version: str) -> dict[str, str]:
    if role == "gpu" and hostname is not None:
        facts = node_facts(facts, hostname)
    contents = dict(role_files(facts, role))
    contents[APT_LOCK_CONF] = render_apt_lock_conf(facts)
    contents[BOOTSTRAP_PATH] = bootstrap_script(facts, role, hostname, version=version)
    return contents


def bootstrap_files(facts: ClusterFacts, role: str, hostname: str | None = None) -> dict[str, str]:
    """Path -> text of every file a node of `role` gets at first boot (its user-data's
    write_files), the bootstrap script recording `bootstrap_version`. `fab update-nodes`
    installs the same files on a running node."""
    _check_role(role)
    return _bundle(facts, role, hostname, bootstrap_version(facts, role, hostname))


def bootstrap_version(facts: ClusterFacts, role: str, hostname: str | None = None) -> str:
    """A content hash of `bootstrap_files` (the script with an empty version in it): the same
    render gives the same version on both sides (infra's user-data, fab's check). No secret is
    in these files (the munge key is made on the controller), so none is in the hash."""
    _check_role(role)
    files = _bundle(facts, role, hostname, version="")
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(f"{path}\0{len(files[path])}\0{files[path]}".encode())
    return digest.hexdigest()[:16]


def user_data(facts: ClusterFacts, role: str, hostname: str | None = None) -> str:
    """The #cloud-config for a node of `role` ("controller" or "gpu").

    A GPU node given by `hostname` gets files made from `node_facts` only (the controller
    and itself): adding or removing other nodes leaves its user-data unchanged.
    The node names itself in the bootstrap script's `hostname` step: `hostname` if
    given (must be a host of that role), else the cluster host whose fixed IP this
    machine has. One user-data then serves every GPU node. cloud-init is told
    `preserve_hostname: true` so it never renames the node on later boots (with
    it, cloud-init ignores `hostname:`/`fqdn:` keys, so the script sets the name).
    The text is for reading and tests; EC2 gets it gzip-compressed (`user_data_base64`),
    which is what must fit its 16 KiB.
    """
    _check_role(role)
    names = [facts.controller.name] if role == "controller" else [h.name for h in facts.gpu_nodes]
    if not names:
        raise ValueError("the cluster has no GPU nodes (gpu_nodes is empty)")
    if role == "controller":
        hostname = facts.controller.name
    if hostname is not None and hostname not in names:
        raise ValueError(f"{hostname!r} is not a {role} host of cluster {facts.cluster_name!r}")
    contents = bootstrap_files(facts, role, hostname)
    if role == "gpu" and hostname is not None:
        facts = node_facts(facts, hostname)
    ctx = _context(facts)
    ctx.update(role=role, packages=role_packages(facts.platform, role))
    files = [{"path": path, "permissions": f"0{FILE_MODES.get(path, 0o644):o}", "content": text}
             for path, text in shipped(contents).items()]
    return _TEMPLATES.get_template("cloud-config.yaml.j2").render(files=files, **ctx)


def user_data_gzip(facts: ClusterFacts, role: str, hostname: str | None = None) -> bytes:
    """`user_data` gzip-compressed: the bytes EC2 hands the instance. cloud-init unpacks gzip
    user-data before it reads it (cloudinit/user_data.py: `util.decomp_gzip`), and EC2's 16 KiB
    limit applies to these bytes, before base64: about a third of the plain text's size, so
    a /26 full of nodes fits with room to spare."""
    raw = gzip.compress(user_data(facts, role, hostname).encode(), mtime=0)
    if len(raw) > MAX_USER_DATA_BYTES:
        raise ValueError(
            f"{role} user-data is {len(raw)} bytes gzip-compressed, over EC2's "
            f"{MAX_USER_DATA_BYTES}; use fewer GPU nodes"
        )
    return raw


def user_data_base64(facts: ClusterFacts, role: str, hostname: str | None = None) -> str:
    """`user_data_gzip` base64-encoded, for the instances' `user_data_base64` input (pulumi_aws
    ec2/instance.py: "gzip-encoded user data must be base64-encoded and passed via this argument")."""
    return base64.b64encode(user_data_gzip(facts, role, hostname)).decode()


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)} (got {role!r})")
