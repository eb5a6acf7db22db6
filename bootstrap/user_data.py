"""A node's first boot packaged for EC2, and its version.

`bootstrap_files`: every file a node of a role gets, its bootstrap script recording
`bootstrap_version` (a hash of what the hosts receive); `user_data`: those files as #cloud-config,
and gzip-compressed and base64-encoded for the instances' `user_data_base64`. `fab update-nodes`
installs the same files on a running node and compares versions.
"""

from __future__ import annotations

import base64
import gzip
import hashlib

from bootstrap.node_layout import APT_LOCK_CONF, FILE_MODES, check_role
from bootstrap.render import node_facts, render_apt_lock_conf, render_bootstrap_script, render_cloud_config, role_files
from bootstrap.shipped_form import shipped
from cluster.facts import ClusterFacts
from cluster.hostpaths import BOOTSTRAP_PATH

# EC2 refuses user-data over 16 KiB (raw, before base64).
MAX_USER_DATA_BYTES = 16384


def _bundle(facts: ClusterFacts, role: str, hostname: str | None, version: str) -> dict[str, str]:
    if role == "gpu" and hostname is not None:
        facts = node_facts(facts, hostname)
    contents = dict(role_files(facts, role))
    contents[APT_LOCK_CONF] = render_apt_lock_conf(facts)
    contents[BOOTSTRAP_PATH] = render_bootstrap_script(facts, role, hostname, version)
    return contents


def bootstrap_files(facts: ClusterFacts, role: str, hostname: str | None = None) -> dict[str, str]:
    """Path -> text of every file a node of `role` gets at first boot (its user-data's
    write_files), the bootstrap script recording `bootstrap_version`. `fab update-nodes`
    installs the same files on a running node."""
    check_role(role)
    return _bundle(facts, role, hostname, bootstrap_version(facts, role, hostname))


def bootstrap_script(facts: ClusterFacts, role: str, hostname: str | None = None) -> str:
    """The role's bootstrap script as a node gets it (`bootstrap_files`), recording `bootstrap_version`.
    `hostname`: the name to take; None: the cluster host whose IP this machine has."""
    return bootstrap_files(facts, role, hostname)[BOOTSTRAP_PATH]


def bootstrap_version(facts: ClusterFacts, role: str, hostname: str | None = None) -> str:
    """A content hash of `bootstrap_files` as user-data carries them (`shipped`: no comments or
    docstrings; the script with an empty version in it): the same render gives the same version on
    both sides (infra's user-data, fab's check). Only what the hosts run is hashed: a comment
    (such as the bootstrap script's note of the local cluster's skipped steps) changes no node's
    version. No secret is in these files (the munge key is made on the controller), so none is
    in the hash."""
    check_role(role)
    files = shipped(_bundle(facts, role, hostname, version=""))
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
    check_role(role)
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
    files = [{"path": path, "permissions": f"0{FILE_MODES.get(path, 0o644):o}", "content": text}
             for path, text in shipped(contents).items()]
    return render_cloud_config(facts, role, files)


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
