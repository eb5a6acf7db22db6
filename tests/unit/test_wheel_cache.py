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
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import fields, replace
from pathlib import Path

import pytest

from bootstrap import node_layout, node_pins, render, user_data
from cluster.targets.local import LOCAL_SKIP_STEPS
from tests.unit.test_bootstrap_render import FACTS

PINS = {"sgpu-tiny": "1.0"}
WANT = "sgpu-tiny==1.0"


def this_machine(platform):
    """`platform` with this machine's Python, glibc and machine: the controller's `wheels` step
    downloads only where its own interpreter is the GPU nodes' (it checks), and here the
    controller's python3 is this one."""
    import platform as py

    have = {"python": f"{sys.version_info[0]}.{sys.version_info[1]}", "glibc": py.libc_ver()[1], "arch": py.machine()}
    return replace(platform, **{k: v for k, v in have.items() if k in {f.name for f in fields(platform)}})


def _wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = (),
           tag: str = "py3-none-any", says: str | None = None) -> Path:
    """A minimal wheel (one module whose VERSION is `says`, default the version) with the given
    tag that pip installs for real."""
    mod = name.replace("-", "_")
    dist = f"{mod}-{version}.dist-info"
    files = {
        f"{mod}.py": f"VERSION = {says or version!r}\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\n" + f"Name: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": f"Wheel-Version: 1.0\nGenerator: slurm-gpu-tests\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    out = directory / f"{mod}-{version}-{tag}.whl"
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
    monkeypatch.setattr(node_pins, "TRAINING_PACKAGES", tuple(PINS))
    monkeypatch.setattr(node_pins, "training_pins", lambda *a: dict(PINS))
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
    facts = FACTS["l4x2"]
    facts = replace(facts, scratch=str(tmp_path / "scratch"), platform=this_machine(facts.platform))
    (tmp_path / "scratch").mkdir()

    def script(role: str) -> Path:
        text = user_data.bootstrap_script(facts, role)
        body, tail = text.rsplit("run_steps", 1)  # the functions, not the run
        assert tail.strip() == ""
        path = tmp_path / f"{role}.sh"
        path.write_text(body)
        return path

    scripts = {role: script(role) for role in node_layout.ROLES}
    cache = Path(node_pins.wheel_cache(facts, [WANT]))

    def run(role: str, call: str, background: str = "") -> subprocess.CompletedProcess:
        cmd = f'source "$S"; STATE_DIR="$ST"; STEPS_DIR="$ST"; {background} {call}'
        env = {"PATH": f"{bindir}:/usr/bin:/bin", "S": str(scripts[role]), "ST": str(state),
               "PIP_CONFIG_FILE": str(conf), "HOME": str(tmp_path)}
        return subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=300)

    return {"run": run, "scripts": scripts, "cache": cache, "index": index, "venv": venv, "state": state, "facts": facts}


def _installed(venv: Path, module: str = "sgpu_tiny") -> str:
    res = subprocess.run([str(venv / "bin/python"), "-c", f"import sgpu_tiny, sgpu_dep; print({module}.VERSION)"],
                         capture_output=True, text=True)
    return res.stdout.strip()


def test_controller_fills_the_cache_once_for_the_gpu_platform(world):
    res = world["run"]("controller", "step_wheels")
    assert res.returncode == 0, res.stdout + res.stderr
    cache = world["cache"]
    assert cache.parent == Path(world["facts"].scratch) / "wheels"
    assert cache.name.startswith(f"py{world['facts'].platform.python}-")
    assert sorted(p.name for p in cache.iterdir()) == [
        ".complete", node_pins.WHEEL_MANIFEST, "sgpu_dep-2.0-py3-none-any.whl", "sgpu_tiny-1.0-py3-none-any.whl"]
    assert (cache / ".complete").read_text().strip() == WANT
    # Every wheel (the dependency too) pinned to its bytes: what the nodes install --require-hashes.
    assert (cache / node_pins.WHEEL_MANIFEST).read_text().splitlines() == [
        f"{name}=={version} --hash=sha256:{hashlib.sha256((cache / wheel).read_bytes()).hexdigest()}"
        for name, version, wheel in (("sgpu_dep", "2.0", "sgpu_dep-2.0-py3-none-any.whl"),
                                     ("sgpu_tiny", "1.0", "sgpu_tiny-1.0-py3-none-any.whl"))]
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


def test_a_hostile_failed_record_reaches_the_console_as_one_line(world, tmp_path):
    """/scratch is not the controller's alone: a `.failed` record holding a forged host key block must not
    become console lines fab would pin from (ops/ssh/hostkeys.py); the console is the script's stdout."""
    from ops.ssh import hostkeys

    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "real")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "evil")], check=True)
    real, evil = ((tmp_path / f"{k}.pub").read_text().split()[:2] for k in ("real", "evil"))
    cache = world["cache"]
    cache.parent.mkdir(parents=True)
    Path(f"{cache}.failed").write_text(f"x\n{hostkeys.KEYS_BEGIN}\n{' '.join(evil)}\n{hostkeys.KEYS_END}\n\x1b[2J")
    res = world["run"]("gpu", f'install_training_stack "{world["venv"]}" "{WANT}"')
    assert res.returncode == 0, res.stdout + res.stderr
    said = [line for line in res.stdout.splitlines() if "the controller could not fill" in line]
    assert len(said) == 1 and hostkeys.KEYS_BEGIN in said[0] and "\x1b" not in said[0]  # one printable line
    assert not any(line.strip() in (hostkeys.KEYS_BEGIN, hostkeys.KEYS_END) for line in res.stdout.splitlines())
    console = (f"{hostkeys.KEYS_BEGIN}\n{' '.join(real)}\n{hostkeys.KEYS_END}\n"
               "slurm-gpu-bootstrap(gpu): step training\n" + res.stdout)
    assert hostkeys.parse_console_output(console) == [tuple(real)]


@pytest.mark.parametrize("attack", ["changed", "planted"])
def test_gpu_node_installs_only_the_wheels_the_controller_hashed(world, attack):
    """A wheel changed in place (same name, other bytes) fails its hash: the node falls back to the
    index. A newer dependency planted beside the real one is never taken: the manifest pins each
    wheel the controller downloaded (real pip, --require-hashes)."""
    assert world["run"]("controller", "step_wheels").returncode == 0
    cache = world["cache"]
    if attack == "changed":
        (cache / "sgpu_tiny-1.0-py3-none-any.whl").unlink()
        _wheel(cache, "sgpu-tiny", "1.0", ("sgpu-dep>=2",), says="planted")
    else:
        _wheel(cache, "sgpu-dep", "3.0")
    res = world["run"]("gpu", f'install_training_stack "{world["venv"]}" "{WANT}"')
    assert res.returncode == 0, res.stdout + res.stderr
    assert (_installed(world["venv"]), _installed(world["venv"], "sgpu_dep")) == ("1.0", "2.0"), res.stdout + res.stderr
    source = (world["state"] / "training-source").read_text()
    if attack == "changed":
        assert "THESE PACKAGES DO NOT MATCH THE HASHES" in res.stdout + res.stderr
        assert source.startswith("index") and "pip could not install from" in source
    else:
        assert source.startswith(f"cache {cache}")


@pytest.mark.parametrize("loosen", ["cache_not_roots", "wheels_dir_group_writable", "scratch_not_sticky"])
def test_gpu_node_uses_no_cache_that_another_user_could_write(world, loosen):
    """Root's alone, or not used at all: a cache someone else owns or may write, or a scratch where
    anyone may rename it (writable, not sticky), sends the node to the index with the reason."""
    assert world["run"]("controller", "step_wheels").returncode == 0
    cache = world["cache"]
    if loosen == "cache_not_roots":
        os.chown(cache, 65534, 65534)
    elif loosen == "wheels_dir_group_writable":
        cache.parent.chmod(0o775)
    else:
        Path(world["facts"].scratch).chmod(0o777)
    res = world["run"]("gpu", f'install_training_stack "{world["venv"]}" "{WANT}"')
    assert res.returncode == 0, res.stdout + res.stderr
    source = (world["state"] / "training-source").read_text()
    assert source.startswith("index") and "not root's alone, so unused" in source, source
    assert _installed(world["venv"]) == "1.0"  # from the index


def test_a_user_cannot_rename_or_write_the_cache_the_controller_made(world):
    """The controller's `scratch` and `wheels` steps as rendered, then a user (the admin's group,
    as jobs are) tries what a job on any node could: rename the cache's directory, plant a wheel.
    Both refused by the kernel (sticky, root-owned scratch; root's 0755 cache); the user still
    makes its own directories on scratch."""
    base = Path(tempfile.mkdtemp(prefix="sgpu-wheels-", dir="/var/tmp"))  # not under root's 0700 tmp
    try:
        base.chmod(0o755)
        # The job user: one that exists on every machine (the bootstrap's jobuser step is not run here).
        facts = replace(world["facts"], scratch=str(base / "scratch"), ssh_user="nobody",
                        job_user="daemon", job_uid=1)
        world["scripts"]["controller"].write_text(
            user_data.bootstrap_script(facts, "controller").rsplit("run_steps", 1)[0])
        res = world["run"]("controller", "step_scratch; step_wheels")
        assert res.returncode == 0, res.stdout + res.stderr
        scratch = Path(facts.scratch)
        cache = Path(node_pins.wheel_cache(facts, [WANT]))
        modes = {p: (p.stat().st_uid, p.stat().st_gid, stat.S_IMODE(p.stat().st_mode))
                 for p in (scratch, cache.parent, cache, cache / node_pins.WHEEL_MANIFEST)}
        assert modes == {scratch: (0, 65534, 0o1775), cache.parent: (0, 0, 0o755), cache: (0, 0, 0o755),
                         cache / node_pins.WHEEL_MANIFEST: (0, 0, 0o644)}
        assert (scratch / "logs").stat().st_uid == 1  # what jobs write is the job user's
        as_admin = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        as_job = ["setpriv", "--reuid=1", "--regid=1", "--clear-groups"]
        for who in (as_admin, as_job):
            for attempt in ([f"mv {cache.parent} {scratch}/moved"], [f"mv {cache} {cache}.moved"],
                            [f"cp {cache}/sgpu_dep-2.0-py3-none-any.whl {cache}/sgpu_dep-3.0-py3-none-any.whl"]):
                res = subprocess.run([*who, "sh", "-c", *attempt], capture_output=True, text=True)
                # EPERM from the sticky bit (rename out of scratch), EACCES from the cache's 0755.
                assert res.returncode != 0 and re.search("Operation not permitted|Permission denied",
                                                         res.stderr), (who, attempt, res.stderr)
        as_user = as_admin
        assert cache.is_dir() and not (cache / "sgpu_dep-3.0-py3-none-any.whl").exists()
        res = subprocess.run([*as_user, "mkdir", f"{scratch}/a-job-dir"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
    finally:
        shutil.rmtree(base)


def test_controller_and_nodes_name_one_cache_per_pins_python_and_tags():
    from cluster.platform import BOOT_DEBIAN12

    facts = FACTS["l4x2"]
    pins = node_pins.training_pins()
    want = [f"{n}=={pins[n]}" for n in node_pins.TRAINING_PACKAGES]
    cache = node_pins.wheel_cache(facts, want)
    for role in node_layout.ROLES:
        assert f"cache='{cache}'" in user_data.bootstrap_script(facts, role)
    assert cache.startswith("/scratch/wheels/py3.12-")
    assert node_pins.wheel_cache(facts, want[:-1]) != cache  # other pins: another directory
    assert node_pins.wheel_cache(replace(facts, platform=BOOT_DEBIAN12), want).startswith("/scratch/wheels/py3.11-")
    controller = user_data.bootstrap_script(facts, "controller")
    download = controller[controller.index("python3 -m pip download"):].split("; then", 1)[0]
    for flag in ("--only-binary=:all:", "--no-cache-dir"):
        assert flag in download
    # The controller's own interpreter resolves (no --platform list), after checking it is the nodes'.
    assert "--platform" not in download and "--python-version" not in download
    assert "nodes='3.12 2.39 x86_64'" in controller
    assert "wheels" in LOCAL_SKIP_STEPS["controller"]  # the local cluster uses the repo's .venv


# torch 2.13.0 (CUDA 13.0 build) and two of the CUDA libraries it pins, with the only tags the
# real index publishes them under for x86_64 (its file lists): cuDNN only manylinux_2_27, NCCL only
# manylinux_2_18. torch itself is cp312-cp312-manylinux_2_28_x86_64 there; py3-none here, so the
# test runs on any Python. The aarch64 builds are there too: an x86_64 node must not take them.
CUDA_TORCH = "torch==2.13.0"
CUDA_WHEELS = [
    ("torch", "2.13.0", "py3-none-manylinux_2_28_x86_64", ("nvidia-cudnn-cu13==9.20.0.48", "nvidia-nccl-cu13==2.29.7")),
    ("nvidia-cudnn-cu13", "9.20.0.48", "py3-none-manylinux_2_27_x86_64", ()),
    ("nvidia-cudnn-cu13", "9.20.0.48", "py3-none-manylinux_2_27_aarch64", ()),
    ("nvidia-nccl-cu13", "2.29.7", "py3-none-manylinux_2_18_x86_64", ()),
    ("nvidia-nccl-cu13", "2.29.7", "py3-none-manylinux_2_18_aarch64", ()),
]


def pip_failure(output: str, index: Path) -> str:
    """What a failed pip resolution means, told apart by the index's own files: "tag mismatch:
    FILES" where the index holds that version but pip took none of its wheels (their tags), else
    "missing: NAME==VERSION" (pip prints the same "No matching distribution" for both)."""
    m = re.search(r"No matching distribution found for ([A-Za-z0-9_.\-]+)==(\S+)", output)
    assert m, f"pip did not fail to resolve:\n{output}"
    stem = f"{re.sub(r'[-_.]+', '_', m[1]).lower()}-{m[2]}-"
    files = sorted(f.name for f in index.glob("*.whl") if f.name.lower().startswith(stem))
    return f"tag mismatch: {', '.join(files)}" if files else f"missing: {m[1]}=={m[2]}"


@pytest.fixture
def cuda_world(world, monkeypatch):
    """`world` with the index holding torch's CUDA wheels as the real index tags them."""
    for wheel in world["index"].iterdir():
        wheel.unlink()
    for name, version, tag, requires in CUDA_WHEELS:
        _wheel(world["index"], name, version, requires, tag)
    monkeypatch.setattr(node_pins, "TRAINING_PACKAGES", ("torch",))
    monkeypatch.setattr(node_pins, "training_pins", lambda *a: {"torch": "2.13.0"})
    world["cache"] = Path(node_pins.wheel_cache(world["facts"], [CUDA_TORCH]))
    for role in node_layout.ROLES:  # re-rendered with these pins
        text = user_data.bootstrap_script(world["facts"], role)
        world["scripts"][role].write_text(text.rsplit("run_steps", 1)[0])
    return world


def test_wheels_step_downloads_torchs_cuda_libraries_under_their_real_tags(cuda_world):
    """The rendered `wheels` step with real pip: every wheel a node of this platform accepts is
    taken (manylinux_2_27 and 2_18 alike), no other machine's."""
    res = cuda_world["run"]("controller", "step_wheels")
    cache = cuda_world["cache"]
    out = res.stdout + res.stderr
    assert (cache / ".complete").exists(), (
        f"the wheel cache did not fill: {pip_failure(out, cuda_world['index'])}\n{out}")
    assert sorted(p.name for p in cache.glob("*.whl")) == sorted(
        f"{re.sub('-', '_', n)}-{v}-{t}.whl" for n, v, t, _ in CUDA_WHEELS if t.endswith("x86_64"))


@pytest.mark.parametrize("change, meaning", [
    ("cudnn_for_a_newer_glibc", "tag mismatch: nvidia_cudnn_cu13-9.20.0.48-"),
    ("nccl_gone", "missing: nvidia-nccl-cu13==2.29.7"),
])
def test_wheels_step_failure_tells_a_tag_mismatch_from_a_missing_distribution(cuda_world, change, meaning):
    index, glibc = cuda_world["index"], cuda_world["facts"].platform.glibc
    if change == "cudnn_for_a_newer_glibc":  # a wheel this machine's glibc cannot take
        for f in index.glob("nvidia_cudnn_cu13-*"):
            f.unlink()
        newer = f"manylinux_2_{int(glibc.split('.')[1]) + 1}_x86_64"
        _wheel(index, "nvidia-cudnn-cu13", "9.20.0.48", (), f"py3-none-{newer}")
    else:
        for f in index.glob("nvidia_nccl_cu13-*"):
            f.unlink()
    res = cuda_world["run"]("controller", "step_wheels")
    assert res.returncode == 0, res.stderr  # recorded for the nodes, not fatal
    assert Path(f"{cuda_world['cache']}.failed").exists()
    assert pip_failure(res.stdout + res.stderr, index).startswith(meaning)


def test_platform_wheel_tags_take_torchs_cuda_libraries(cuda_world, monkeypatch):
    """`check_wheels` (the pins against another Python's tags, tests/unit/test_target_pins.py) passes
    the platform's tags to pip as --platform: they must include every manylinux tag of its glibc."""
    from bootstrap.wheels import check_wheels

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the environment's settings win over any pip.conf
    monkeypatch.setenv("PIP_FIND_LINKS", str(cuda_world["index"]))
    reqs = ["nvidia-cudnn-cu13==9.20.0.48", "nvidia-nccl-cu13==2.29.7"]
    check = check_wheels(reqs, cuda_world["facts"].platform)
    assert check.ok, check.missing


def test_controller_of_another_platform_records_why_and_fills_nothing(world):
    """A controller whose Python, glibc or machine is not the GPU nodes' would cache wheels they
    cannot install: the step records why (the nodes then use the index) and downloads nothing."""
    facts = replace(world["facts"], platform=replace(world["facts"].platform, glibc="2.99"))
    world["scripts"]["controller"].write_text(user_data.bootstrap_script(facts, "controller").rsplit("run_steps", 1)[0])
    cache = Path(node_pins.wheel_cache(facts, [WANT]))
    res = world["run"]("controller", "step_wheels")
    assert res.returncode == 0, res.stderr
    assert not cache.exists() and not Path(f"{cache}.partial").exists()
    assert "not the GPU nodes'" in Path(f"{cache}.failed").read_text() and " 2.99 " in Path(f"{cache}.failed").read_text()
