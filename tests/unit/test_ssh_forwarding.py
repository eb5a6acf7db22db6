"""Nothing of the admin's machine reaches a cluster host, whatever ~/.ssh/config says.

A real ssh config file that turns on every forwarding (agent, X11, ports) for every host:
- fab's own connections (ops/ssh/remote.py, Fabric/paramiko) are built under it, as Fabric loads
  ~/.ssh/config (from $HOME), and must not forward the agent;
- `fab ssh` (ops/ssh/sshcmd.py) is resolved by OpenSSH itself under it (`ssh -G -F FILE`, which
  applies the file and the command line without connecting), for the host and for the jump; the file
  also shares connections (ControlMaster auto), which fab ssh must neither open nor reuse.
Each test first shows the file does turn forwarding on for a connection built without our options.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest
from fabric import Config, Connection

from ops.ssh import remote, sshcmd
from tests.unit.test_hostkeys import aws_inventory

HOSTILE_CONFIG = """\
Host *
    ForwardAgent yes
    ForwardX11 yes
    ForwardX11Trusted yes
    RemoteForward 52698 localhost:52698
    LocalForward 8080 localhost:80
    DynamicForward 1080
    ControlMaster auto
    ControlPath ~/.ssh/cm-%r@%h:%p
    ControlPersist 10m
"""


@pytest.fixture
def ssh_config(tmp_path, monkeypatch):
    """~/.ssh/config (under a $HOME of our own) asking to forward everything to every host."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    path = home / ".ssh" / "config"
    path.write_text(HOSTILE_CONFIG)
    monkeypatch.setenv("HOME", str(home))
    return path


def test_fab_connections_never_forward_the_agent(ssh_config, tmp_path):
    # The file is read: a plain Fabric connection under it would forward the agent.
    assert Connection("198.51.100.7", config=Config()).forward_agent is True
    cl = remote.connect(aws_inventory(known_hosts=str(tmp_path / "kh")))
    try:
        for c in (cl.controller, *cl.nodes.values()):
            assert c.ssh_config.get("forwardagent") == "yes"  # the config applies to this host ...
            assert c.forward_agent is False  # ... and is overruled
            with pytest.raises(ValueError, match="never forward the SSH agent"):
                c.forward_agent = True
    finally:
        cl.close()


def _resolved(config, argv: list[str]) -> dict[str, list[str]]:
    """OpenSSH's own reading of `argv` (an ssh command line) under the config file `config`."""
    assert argv[0] == "ssh"
    if "--" in argv:
        argv = argv[:argv.index("--")]
    out = subprocess.run(["ssh", "-G", "-F", str(config), *argv[1:]], capture_output=True, text=True,
                         check=True).stdout
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        found.setdefault(key, []).append(value)
    return found


def _forwards_nothing(cfg: dict[str, list[str]]) -> None:
    assert cfg["forwardagent"] == ["no"] and cfg["forwardx11"] == ["no"] and cfg["forwardx11trusted"] == ["no"]
    assert cfg["clearallforwardings"] == ["yes"]
    assert not {"remoteforward", "localforward", "dynamicforward"} & set(cfg), cfg
    # No shared connection: neither a master of its own nor one the admin opened before (whose
    # session, made without these options, may forward the agent). OpenSSH's -G prints
    # ControlMaster=no as "false" and leaves out a ControlPath of "none".
    assert cfg["controlmaster"] == ["false"] and "controlpath" not in cfg, cfg


@pytest.mark.skipif(not shutil.which("ssh"), reason="OpenSSH client not installed")
@pytest.mark.parametrize("host", ["controller", "gpu-node-02"])
def test_fab_ssh_forwards_nothing_to_the_host_or_the_jump(ssh_config, tmp_path, host):
    plain = _resolved(ssh_config, ["ssh", "ubuntu@198.51.100.7"])
    assert plain["forwardagent"] == ["yes"] and "remoteforward" in plain  # what the file asks for
    assert plain["controlmaster"] == ["auto"] and "controlpath" in plain
    argv = sshcmd.ssh_argv(aws_inventory(), host, tmp_path / "kh", identity="/home/me/.ssh/id_ed25519",
                           command="hostname")
    cfg = _resolved(ssh_config, argv)
    _forwards_nothing(cfg)
    if host != "controller":  # the jump through the controller: its own ssh, under the same file
        jump = shlex.split(cfg["proxycommand"][0])
        assert "-W" in jump
        _forwards_nothing(_resolved(ssh_config, jump))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.root
def test_a_real_session_under_forward_agent_yes_gets_no_agent(ssh_config, tmp_path):
    """A real sshd on loopback that permits agent forwarding, a real ssh-agent here, ~/.ssh/config saying
    ForwardAgent yes: the remote command fab runs sees no SSH_AUTH_SOCK, while plain Fabric's does."""
    import os
    import time

    from tests.support import inventories

    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "user.pub").read_text())
    port = _free_port()
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory (as the package makes it)
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", "/dev/null", "-p", str(port),
                             "-o", "ListenAddress=127.0.0.1", "-o", f"HostKey={tmp_path / 'host'}",
                             "-o", f"AuthorizedKeysFile={tmp_path / 'authorized_keys'}",
                             "-o", "PermitRootLogin=prohibit-password", "-o", "AllowAgentForwarding=yes",
                             "-o", "StrictModes=no", "-o", f"PidFile={tmp_path / 'sshd.pid'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    agent = subprocess.run(["ssh-agent", "-s"], capture_output=True, text=True, check=True).stdout
    env = dict(part.split("=", 1) for part in agent.replace(";", "\n").split() if "=" in part)
    try:
        os.environ["SSH_AUTH_SOCK"] = env["SSH_AUTH_SOCK"]
        subprocess.run(["ssh-add", "-q", str(tmp_path / "user")], check=True, env={**os.environ})
        host_pub = (tmp_path / "host.pub").read_text().split()
        known = tmp_path / "known_hosts"
        known.write_text(f"controller {host_pub[0]} {host_pub[1]}\n")
        inv = inventories.make("local", cluster_name="t", controller=("controller", "127.0.0.1"),
                               gpus_per_node=1, gpu_type="sim", python="/usr/bin/python3",
                               service_cmd="true {action} {service}", known_hosts=str(known))
        for _ in range(100):  # sshd is listening once it accepts
            if subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"],
                              stderr=subprocess.DEVNULL).returncode == 0:
                break
            time.sleep(0.1)
        cmd = 'echo "sock=${SSH_AUTH_SOCK:-none}"'
        plain = Connection("127.0.0.1", user="root", port=port, config=Config(),
                           connect_kwargs={"key_filename": [str(tmp_path / "user")]})
        plain.client.load_host_keys(str(known))
        plain.client.set_missing_host_key_policy(__import__("paramiko").AutoAddPolicy())
        try:
            assert plain.run(cmd, hide=True, in_stream=False).stdout.strip() != "sock=none"  # forwarded
        finally:
            plain.close()
        cl = remote.connect(inv, identity=str(tmp_path / "user"))
        cl.controller.port = port
        try:
            assert cl.controller.run(cmd, hide=True, in_stream=False).stdout.strip() == "sock=none"
        finally:
            cl.close()
    finally:
        os.environ.pop("SSH_AUTH_SOCK", None)
        subprocess.run(["kill", env["SSH_AGENT_PID"]], check=False)
        sshd.terminate()
        sshd.wait(timeout=10)
