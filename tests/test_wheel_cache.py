"""The GPU nodes' wheel cache on the shared scratch, run for real with real pip and no network.

The controller's `wheels` step and the GPU node's `install_training_stack` run as rendered, with
a two-wheel stand-in for the training pins (a package and its dependency, built here) and a local
directory standing in for the package index (pip.conf: no-index, find-links), as the boot test's
wheelhouse does. The controller downloads for the GPU platform's Python and wheel tags; a node
installs from the cache alone (no index, no pip.conf), waits for a cache being filled, and falls
back to the index with the reason logged when the cache failed, never started or is broken.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from bootstrap import render
from tests.test_bootstrap_render import FACTS

PINS = {"sgpu-tiny": "1.0"}
WANT = "sgpu-tiny==1.0"


def _wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel (one module) that pip installs for real."""
    mod = name.replace("-", "_")
    dist = f"{mod}-{version}.dist-info"
    files = {
        f"{mod}.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\n" + f"Name: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: slurm-gpu-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    out = directory / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return out


@pytest.fixture(scope="module")
def venv_template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    return path


@pytest.fixture
def world(tmp_path, monkeypatch, venv_template):
    """Rendered scripts with the stand-in pins, an 'index' directory, a fresh venv, python3 with pip."""
    monkeypatch.setattr(render, "TRAINING_PACKAGES", tuple(PINS))
    monkeypatch.setattr(render, "training_pins", lambda *a: dict(PINS))
    monkeypatch.setattr(render, "WHEEL_POLL_S", 1)
    monkeypatch.setattr(render, "WHEEL_START_WAIT_S", 3)
    monkeypatch.setattr(render, "WHEEL_WAIT_S", 20)
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, "sgpu-tiny", "1.0", ("sgpu-dep>=2",))
    _wheel(index, "sgpu-dep", "2.0")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nno-index = true\nfind-links = {index}\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)  # a python3 with pip, as python3-pip gives the controller
    venv = tmp_path / "venv"
    shutil.copytree(venv_template, venv, symlinks=True)
    state = tmp_path / "state"
    state.mkdir()
    facts = replace(FACTS["l4x2"], scratch=str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()

    def script(role: str) -> Path:
        text = render.bootstrap_script(facts, role)
        body, tail = text.rsplit("run_steps", 1)  # the functions, not the run
        assert tail.strip() == ""
        path = tmp_path / f"{role}.sh"
        path.write_text(body)
        return path

    scripts = {role: script(role) for role in render.ROLES}
    cache = Path(render.wheel_cache(facts, [WANT]))

    def run(role: str, call: str, background: str = "") -> subprocess.CompletedProcess:
        cmd = f'source "$S"; STATE_DIR="$ST"; STEPS_DIR="$ST"; {background} {call}'
        env = {"PATH": f"{bindir}:/usr/bin:/bin", "S": str(scripts[role]), "ST": str(state),
               "PIP_CONFIG_FILE": str(conf), "HOME": str(tmp_path)}
        return subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=300)

    return {"run": run, "scripts": scripts, "cache": cache, "index": index, "venv": venv, "state": state, "facts": facts}


def _installed(venv: Path) -> str:
    res = subprocess.run([str(venv / "bin/python"), "-c", "import sgpu_tiny, sgpu_dep; print(sgpu_tiny.VERSION)"],
                         capture_output=True, text=True)
    return res.stdout.strip()


def test_controller_fills_the_cache_once_for_the_gpu_platform(world):
    res = world["run"]("controller", "step_wheels")
    assert res.returncode == 0, res.stdout + res.stderr
    cache = world["cache"]
    assert cache.parent == Path(world["facts"].scratch) / "wheels" and cache.name.startswith("py3.12-")
    assert sorted(p.name for p in cache.iterdir()) == [
        ".complete", "sgpu_dep-2.0-py3-none-any.whl", "sgpu_tiny-1.0-py3-none-any.whl"]  # the dependency too
    assert (cache / ".complete").read_text().strip() == WANT
    assert not Path(f"{cache}.partial").exists() and not Path(f"{cache}.failed").exists()
    assert f"wheel cache {cache}:" in res.stdout
    # Complete: a second run downloads nothing (the index is gone, and it still succeeds).
    shutil.rmtree(world["index"])
    again = world["run"]("controller", "step_wheels")
    assert again.returncode == 0 and "nothing to download" in again.stdout


def test_controller_download_failure_is_recorded_not_fatal(world):
    (world["index"] / "sgpu_dep-2.0-py3-none-any.whl").unlink()  # the dependency cannot be found
    res = world["run"]("controller", "step_wheels")
    assert res.returncode == 0, res.stderr
    cache = world["cache"]
    assert not cache.exists()  # never published half done
    assert "pip download failed" in Path(f"{cache}.failed").read_text()
    assert "could not fill the wheel cache" in res.stdout


def test_gpu_node_installs_from_the_cache_alone(world):
    assert world["run"]("controller", "step_wheels").returncode == 0
    for wheel in world["index"].iterdir():
        wheel.unlink()  # the index has nothing now: only the cache can serve the install
    res = world["run"]("gpu", f'install_training_stack "{world["venv"]}" "{WANT}"')
    assert res.returncode == 0, res.stdout + res.stderr
    assert "training stack from the controller's wheel cache" in res.stdout
    assert _installed(world["venv"]) == "1.0"
    assert (world["state"] / "training-source").read_text().startswith(f"cache {world['cache']}")


def test_gpu_node_waits_for_a_cache_being_filled(world):
    cache = world["cache"]
    Path(f"{cache}.partial").mkdir(parents=True)  # the controller has started; it finishes 2 s later
    res = world["run"]("gpu", f'install_training_stack "{world["venv"]}" "{WANT}"',
                       background=f'( source "{world["scripts"]["controller"]}"; sleep 2; step_wheels >/dev/null ) &')
    assert res.returncode == 0, res.stdout + res.stderr
    assert "waiting for the controller's wheel cache" in res.stdout
    assert "training stack from the controller's wheel cache" in res.stdout
    assert _installed(world["venv"]) == "1.0"


@pytest.mark.parametrize("case, reason", [
    ("failed", "the controller could not fill"),
    ("never_started", "the controller has not started"),
    ("broken", "pip could not install from"),
])
def test_gpu_node_falls_back_to_the_index_with_the_reason(world, case, reason):
    cache = world["cache"]
    if case == "failed":
        cache.parent.mkdir(parents=True)
        Path(f"{cache}.failed").write_text("pip download failed at noon\n")
    elif case == "broken":  # complete by its marker, but a wheel is missing
        assert world["run"]("controller", "step_wheels").returncode == 0
        (cache / "sgpu_dep-2.0-py3-none-any.whl").unlink()
    res = world["run"]("gpu", f'install_training_stack "{world["venv"]}" "{WANT}"')
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"training stack from the package index: {reason}" in res.stdout
    assert _installed(world["venv"]) == "1.0"  # from the index
    assert (world["state"] / "training-source").read_text().startswith("index")


def test_controller_and_nodes_name_one_cache_per_pins_python_and_tags():
    from bootstrap.platform import BOOT_DEBIAN12

    facts = FACTS["l4x2"]
    pins = render.training_pins()
    want = [f"{n}=={pins[n]}" for n in render.TRAINING_PACKAGES]
    cache = render.wheel_cache(facts, want)
    for role in render.ROLES:
        assert f"cache='{cache}'" in render.bootstrap_script(facts, role)
    assert cache.startswith("/scratch/wheels/py3.12-")
    assert render.wheel_cache(facts, want[:-1]) != cache  # other pins: another directory
    assert render.wheel_cache(replace(facts, platform=BOOT_DEBIAN12), want).startswith("/scratch/wheels/py3.11-")
    controller = render.bootstrap_script(facts, "controller")
    for flag in ("--only-binary=:all:", "--implementation cp", "--python-version '3.12'",
                 "--platform 'manylinux_2_28_x86_64'", "--no-cache-dir"):
        assert flag in controller
    assert "wheels" in render.LOCAL_SKIP_STEPS["controller"]  # the local cluster uses the repo's .venv
