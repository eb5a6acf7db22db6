"""Which bootstrap steps a node must run again to go from one rendered bootstrap to another.

`fab update-nodes` installs the newly rendered files on a running node and runs only these steps
(the others through SLURM_GPU_SKIP_STEPS). A step runs again when its own function changed, or a
file it installs or reads changed; a change anywhere else in the script (a helper, the shared
head) or to a file no step is known to read runs every step: each step is safe to run again.
"""

from __future__ import annotations

import re

from bootstrap import node_layout
from cluster import hostpaths

# The file each rendered file is read by: the step that checks or merges it. None: read by its
# program itself (apt reads its lock wait), no step to run.
FILE_STEPS: dict[str, str | None] = {
    node_layout.HOSTS_BLOCK_FILE: "hosts",
    hostpaths.HEALTHCHECK_PATH: "healthcheck",
    node_layout.SLURMD_ENV_FILE: "services",
    node_layout.SLURMD_DROPIN: "services",
    node_layout.APT_LOCK_CONF: None,
}

# A top-level bash function: `name() {` ... `}` at column 0 (how bootstrap/scripts/ write them).
_FUNCTION = re.compile(r"^(\w+)\(\) \{$")
_VERSION_LINE = "BOOTSTRAP_VERSION="


def functions(script: str) -> tuple[dict[str, str], str]:
    """The script's top-level functions (name -> text) and the rest of its code, comments and
    the version line left out (they change nothing a step does)."""
    funcs: dict[str, str] = {}
    rest: list[str] = []
    name, body = None, []
    for line in script.splitlines():
        if name is None:
            m = _FUNCTION.match(line)
            if m:
                name, body = m.group(1), [line]
            elif line.strip() and not line.lstrip().startswith("#") and not line.startswith(_VERSION_LINE):
                rest.append(line)
            continue
        body.append(line)
        if line == "}":
            funcs[name] = "\n".join(body)
            name = None
    return funcs, "\n".join(rest)


def changed_steps(old_script: str | None, new_script: str, changed_files: set[str],
                  steps: tuple[str, ...]) -> list[str]:
    """The steps (in `steps` order) to run again; all of them when the old script is unknown."""
    if old_script is None:
        return list(steps)
    old_funcs, old_rest = functions(old_script)
    new_funcs, new_rest = functions(new_script)
    helpers = {f for f in set(old_funcs) | set(new_funcs) if not f.startswith("step_")}
    if old_rest != new_rest or any(old_funcs.get(f) != new_funcs.get(f) for f in helpers):
        return list(steps)
    picked = {s for s in steps if old_funcs.get(f"step_{s}") != new_funcs.get(f"step_{s}")}
    for path in changed_files - {hostpaths.BOOTSTRAP_PATH}:
        if path not in FILE_STEPS:
            return list(steps)
        if FILE_STEPS[path]:
            picked.add(FILE_STEPS[path])
    return [s for s in steps if s in picked]
