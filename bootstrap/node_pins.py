"""The versions the nodes install, read from the repository's requirements.txt.

The GPU nodes' training stack and the controller's power-save venv are pinned to the same
versions as requirements.txt (the one place versions live); the GPU nodes' wheel cache on the
shared scratch is named after those pins.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from bootstrap.node_layout import POWER_PACKAGES
from cluster.facts import ClusterFacts
from cluster.platform import Platform

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements.txt"

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
