"""The slurm-gpu security invariants as Pulumi CrossGuard policies.

Each check reads the engine-level (camelCase) property names that pulumi_aws 7.x
registers, e.g. `metadataOptions.httpTokens` on aws:ec2/instance:Instance. Rules
accept every way the AWS provider can express the same thing (inline security
group rules, aws:ec2/securityGroupRule, aws:vpc/securityGroupIngressRule), so a
refactor of infra/ cannot slip past them.

During `pulumi preview` some values (ids, names) are not known yet. Stack
policies then follow the engine's property dependencies instead of ids; a
resource policy that must read an unknown value is reported by the SDK as
"can't run during preview" and runs for real during `pulumi up`.

The module imports nothing from the project, so the pack runs on its own:
`pulumi preview --policy-pack policy`.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import gzip
import ipaddress
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import yaml
from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.proxy import UnknownValueError

PACK_NAME = "slurm-gpu-security"

INSTANCE = "aws:ec2/instance:Instance"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
VOLUME = "aws:ebs/volume:Volume"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"
SG_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
VPC_INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
VPC_EGRESS = "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule"
NETWORK_INTERFACE = "aws:ec2/networkInterface:NetworkInterface"
EIP = "aws:ec2/eip:Eip"
EIP_ASSOCIATION = "aws:ec2/eipAssociation:EipAssociation"
SUBNET = "aws:ec2/subnet:Subnet"
EFA_TYPES = ("efa", "efa-only")
PLACEMENT_GROUP = "aws:ec2/placementGroup:PlacementGroup"
KEY_PAIR = "aws:ec2/keyPair:KeyPair"
IAM_ROLE = "aws:iam/role:Role"
IAM_ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
IAM_POLICY = "aws:iam/policy:Policy"

SSH_PORT = 22
# The SSH source (adminCidr) is one address or a small range: at most a /16 of IPv4 (as cluster/stack_config.py
# allows) or a /48 of IPv6 (one site's allocation, RFC 6177), never loopback or link-local. Wider needs
# the pack's config `allowWideAdminCidr: true` (`pulumi preview --policy-pack policy
# --policy-pack-config FILE`), the same override the stack setting slurm-gpu:allowWideAdminCidr is.
WIDE_OVERRIDE = "allowWideAdminCidr"
NARROWEST_WIDE_PREFIX = {4: 16, 6: 48}
OVERRIDE_SCHEMA = PolicyConfigSchema(properties={WIDE_OVERRIDE: {"type": "boolean", "default": False}})
ALL_PROTOCOLS = ("-1", "all")
TCP = ("tcp", "6")
# A munge key is at least 128 random bytes (mungekey's default; Debian's old
# create-munge-key wrote 1024): as base64 that is a run of >= 172 characters,
# as hex >= 256. Nothing else the project puts in user-data looks like that.
MIN_KEY_BYTES = 128
B64_BLOB = re.compile(r"[A-Za-z0-9+/]{" + str(MIN_KEY_BYTES * 4 // 3) + r",}={0,2}")
HEX_BLOB = re.compile(r"\b[0-9a-fA-F]{" + str(MIN_KEY_BYTES * 2) + r",}\b")
# An OpenSSH public key line carries a long base64 run that is not a secret.
SSH_PUBLIC_KEY = re.compile(
    r"^(ssh-(rsa|ed25519|dss)|ecdsa-sha2-nistp(256|384|521)|sk-(ssh-ed25519|ecdsa-sha2-nistp256)@openssh\.com)"
    r" [A-Za-z0-9+/]+={0,2}( \S.*)?$"
)
PUBLIC_KEY_PREFIX = re.compile(
    r"(ssh-(rsa|ed25519|dss)|ecdsa-sha2-nistp(256|384|521)|sk-[a-z0-9-]+@openssh\.com) $"
)
MUNGE_PATH = re.compile(r"(^|/)munge\.key$|^/etc/munge/")


# ---------------------------------------------------------------- helpers

def _get(props: Mapping[str, Any] | None, *path: str, default: Any = None) -> Any:
    """props[a][b]... or default when any step is missing or None (unknowns raise)."""
    cur: Any = props
    for key in path:
        if not isinstance(cur, Mapping) or key not in cur or cur[key] is None:
            return default
        cur = cur[key]
    return cur


def _known(props: Mapping[str, Any] | None, *path: str) -> tuple[bool, Any]:
    """(True, value) or (False, None) when the value is unknown during preview."""
    try:
        return True, _get(props, *path)
    except UnknownValueError:
        return False, None


def _list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return [value]
    return list(value)


def _port(value: Any) -> int | None:
    return None if value is None else int(float(value))


def _is_internet(cidr: str) -> bool:
    try:
        return ipaddress.ip_network(str(cidr), strict=False).prefixlen == 0
    except ValueError:
        return False


def _covers_ssh(protocol: Any, from_port: Any, to_port: Any) -> bool:
    proto = str(protocol).lower()
    if proto in ALL_PROTOCOLS:
        return True
    if proto not in TCP:
        return False
    lo, hi = _port(from_port), _port(to_port)
    if lo is None or hi is None:
        return True  # no port range on a tcp rule: AWS reads it as every port
    return lo <= SSH_PORT <= hi


def _is_exactly_ssh(protocol: Any, from_port: Any, to_port: Any) -> bool:
    return str(protocol).lower() in TCP and _port(from_port) == SSH_PORT == _port(to_port)


def _describe(protocol: Any, from_port: Any, to_port: Any) -> str:
    proto = str(protocol).lower()
    if proto in ALL_PROTOCOLS:
        return "all traffic"
    lo, hi = _port(from_port), _port(to_port)
    ports = f"port {lo}" if lo == hi else f"ports {lo}-{hi}"
    return f"{proto} {ports}"


# ------------------------------------------------ security group ingress

class _Ingress:
    """One ingress permission from a CIDR source, in any of the provider's shapes."""

    def __init__(self, where: str, protocol: Any, from_port: Any, to_port: Any, cidr: str):
        self.where, self.protocol, self.from_port, self.to_port, self.cidr = (
            where, protocol, from_port, to_port, cidr)

    @property
    def what(self) -> str:
        return _describe(self.protocol, self.from_port, self.to_port)


def _cidr_ingress(resource_type: str, props: Mapping[str, Any]) -> list[_Ingress]:
    """Ingress permissions whose source is an address range (not a group or itself)."""
    found: list[_Ingress] = []

    def inline(where: str, rule: Mapping[str, Any]) -> None:
        for cidr in _list(_get(rule, "cidrBlocks")) + _list(_get(rule, "ipv6CidrBlocks")):
            found.append(_Ingress(where, _get(rule, "protocol"), _get(rule, "fromPort"),
                                  _get(rule, "toPort"), cidr))

    if resource_type == SECURITY_GROUP:
        for i, rule in enumerate(_list(_get(props, "ingress"))):
            inline(f"ingress[{i}]", rule)
    elif resource_type == SG_RULE and _get(props, "type") == "ingress":
        inline("rule", props)
    elif resource_type == VPC_INGRESS:
        for key in ("cidrIpv4", "cidrIpv6"):
            cidr = _get(props, key)
            if cidr:
                found.append(_Ingress(key, _get(props, "ipProtocol"), _get(props, "fromPort"),
                                      _get(props, "toPort"), cidr))
    return found


def _wide_allowed(args) -> bool:
    """The pack's config says `allowWideAdminCidr: true` for this policy (a JSON boolean, nothing else)."""
    return (args.get_config() or {}).get(WIDE_OVERRIDE) is True


def check_ssh_not_open(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if _wide_allowed(args):
        return
    for perm in _cidr_ingress(args.resource_type, args.props):
        if _is_internet(perm.cidr) and _covers_ssh(perm.protocol, perm.from_port, perm.to_port):
            report(f"{perm.where}: {perm.what} from {perm.cidr} opens SSH (port 22) to the whole "
                   "internet; allow SSH only from your adminCidr (e.g. 203.0.113.7/32)")


def check_ssh_source_is_narrow(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """SSH comes from a narrow range: not loopback or link-local (a mistake: nothing of yours connects from
    there), not wider than a /16 (v4) or /48 (v6) unless the pack's config allows wide ranges. /0 is left to
    ssh-not-open-to-internet."""
    wide_ok = _wide_allowed(args)
    for perm in _cidr_ingress(args.resource_type, args.props):
        if not _covers_ssh(perm.protocol, perm.from_port, perm.to_port):
            continue
        try:
            net = ipaddress.ip_network(str(perm.cidr), strict=False)
        except ValueError:
            continue
        if net.is_loopback or net.is_link_local:
            kind = "loopback" if net.is_loopback else "link-local"
            report(f"{perm.where}: {perm.what} from {perm.cidr}, a {kind} range: no admin connects from "
                   "there; allow SSH from your own public address (e.g. 203.0.113.7/32)")
        elif 0 < net.prefixlen < NARROWEST_WIDE_PREFIX[net.version] and not wide_ok:
            report(f"{perm.where}: {perm.what} from {perm.cidr} is wider than a "
                   f"/{NARROWEST_WIDE_PREFIX[net.version]}: SSH open to that much of the internet; narrow "
                   f"it to your address (e.g. 203.0.113.7/32), or set the pack's config {WIDE_OVERRIDE}: true")


def check_no_other_cidr_ingress(args: ResourceValidationArgs, report: ReportViolation) -> None:
    for perm in _cidr_ingress(args.resource_type, args.props):
        if not _is_exactly_ssh(perm.protocol, perm.from_port, perm.to_port):
            report(f"{perm.where}: {perm.what} from {perm.cidr}: only SSH (tcp 22) may enter the "
                   "cluster from outside its security group; open other ports only to the group itself")


# --------------------------------------------------------------- IMDSv2

def check_imdsv2(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type not in (INSTANCE, LAUNCH_TEMPLATE):
        return
    if _get(args.props, "metadataOptions", "httpEndpoint") == "disabled":
        return  # no metadata service at all is stricter still
    tokens = _get(args.props, "metadataOptions", "httpTokens")
    if tokens != "required":
        shown = f'"{tokens}"' if tokens is not None else "not set (IMDSv1 allowed)"
        report(f"metadataOptions.httpTokens is {shown}: set metadata_options http_tokens=\"required\" "
               "so only IMDSv2 session tokens reach the instance metadata")


# ----------------------------------------------------------- encryption

def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def check_volumes_encrypted(args: ResourceValidationArgs, report: ReportViolation) -> None:
    props = args.props
    if args.resource_type == INSTANCE:
        root = _get(props, "rootBlockDevice")
        if not _truthy(_get(root, "encrypted")):
            report("rootBlockDevice.encrypted is not true: set root_block_device encrypted=True")
        for i, dev in enumerate(_list(_get(props, "ebsBlockDevices"))):
            if not _truthy(_get(dev, "encrypted")):
                name = _get(dev, "deviceName", default="?")
                report(f"ebsBlockDevices[{i}] ({name}).encrypted is not true: set encrypted=True")
    elif args.resource_type == VOLUME:
        if not _truthy(_get(props, "encrypted")):
            report("encrypted is not true: set encrypted=True on the EBS volume")
    elif args.resource_type == LAUNCH_TEMPLATE:
        for i, dev in enumerate(_list(_get(props, "blockDeviceMappings"))):
            ebs = _get(dev, "ebs")
            if ebs is not None and not _truthy(_get(ebs, "encrypted")):
                report(f"blockDeviceMappings[{i}].ebs.encrypted is not true: set encrypted=\"true\"")


# ------------------------------------------------------ secrets in props

def _strings(value: Any, path: str = "") -> Iterable[tuple[str, str]]:
    """(property path, string) for every string under value; unknowns are skipped."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, Mapping):
        for key in list(value):
            try:
                child = value[key]
            except UnknownValueError:
                continue
            yield from _strings(child, f"{path}.{key}" if path else str(key))
    elif isinstance(value, Sequence) and not isinstance(value, bytes):
        for i in range(len(value)):
            try:
                child = value[i]
            except UnknownValueError:
                continue
            yield from _strings(child, f"{path}[{i}]")


def check_no_private_key(args: ResourceValidationArgs, report: ReportViolation) -> None:
    texts = list(_strings(args.props))
    for prop, text in _user_data_texts(args.resource_type, args.props):
        ud = _UserData(prop, text)
        # userData itself is among the strings above; add what only decoding shows.
        texts += [t for t in ud.decoded_texts() if t[0] != "userData"]
    for path, text in texts:
        if "PRIVATE KEY" in text:
            report(f"{path} holds private key material (\"PRIVATE KEY\"): never pass a private key "
                   "to a resource; the key pair takes the public key only")


def check_key_pair_public(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != KEY_PAIR:
        return
    key = _get(args.props, "publicKey")
    if not isinstance(key, str) or not SSH_PUBLIC_KEY.match(key.strip()):
        report("publicKey is not an OpenSSH public key line (ssh-ed25519 AAAA... comment): set "
               "slurm-gpu:sshPublicKey to the contents of your ~/.ssh/id_*.pub")


# ------------------------------------------------------- user-data keys

ENCODINGS = {"b64": False, "base64": False, "gz+b64": True, "gzip+base64": True,
             "gz+base64": True, "gzip+b64": True}


def _decode_user_data(raw: str, base64_encoded: bool) -> str:
    """The user-data text: base64 and gzip undone (EC2 and cloud-init accept both)."""
    data = raw.encode()
    if base64_encoded:
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            return raw
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            return raw
    return data.decode("utf-8", "replace")


def _user_data_texts(resource_type: str, props: Mapping[str, Any]) -> list[tuple[str, str]]:
    texts = []
    if resource_type == INSTANCE:
        for prop, encoded in (("userData", False), ("userDataBase64", True)):
            raw = _get(props, prop)
            if isinstance(raw, str):
                texts.append((prop, _decode_user_data(raw, encoded)))
    elif resource_type == LAUNCH_TEMPLATE:
        raw = _get(props, "userData")  # base64 on launch templates
        if isinstance(raw, str):
            texts.append(("userData", _decode_user_data(raw, True)))
    return texts


class _UserData:
    """A user-data text split into what cloud-init will write: the text itself with
    encoded write_files contents taken out, and each of those contents decoded."""

    def __init__(self, prop: str, text: str):
        self.prop = prop
        self.text = text
        self.files: list[tuple[int, str, str | None, bytes | None]] = []  # index, path, encoding, bytes
        doc = None
        if text.lstrip().startswith("#cloud-config"):
            try:
                doc = yaml.safe_load(text)
            except yaml.YAMLError:
                doc = None
        entries = doc.get("write_files") if isinstance(doc, dict) else None
        for i, entry in enumerate(_list(entries)):
            if not isinstance(entry, dict):
                continue
            path, content = str(entry.get("path", "")), entry.get("content")
            encoding = str(entry.get("encoding", "")).lower() or None
            data: bytes | None = None
            if isinstance(content, str):
                if encoding in ENCODINGS:
                    self.text = self.text.replace(content, "")
                    try:
                        data = base64.b64decode(content)
                        if ENCODINGS[encoding]:
                            data = gzip.decompress(data)
                    except (binascii.Error, ValueError, OSError, EOFError):
                        data = None
                else:
                    data = content.encode()
            self.files.append((i, path, encoding, data))

    def decoded_texts(self) -> Iterable[tuple[str, str]]:
        """(where, text) for the user-data and every write_files content that is text."""
        yield self.prop, self.text
        for i, path, _, data in self.files:
            if data is not None:
                try:
                    yield f"{self.prop} write_files[{i}] ({path})", data.decode("utf-8")
                except UnicodeDecodeError:
                    pass


def _key_blobs(text: str) -> list[str]:
    """Long base64/hex runs that are not part of an OpenSSH public key."""
    blobs = []
    for m in B64_BLOB.finditer(text):
        if PUBLIC_KEY_PREFIX.search(text[max(0, m.start() - 40):m.start()]):
            continue
        blobs.append(m.group(0))
    blobs += [m.group(0) for m in HEX_BLOB.finditer(text)]
    return blobs


def check_user_data_has_no_munge_key(args: ResourceValidationArgs, report: ReportViolation) -> None:
    for prop, text in _user_data_texts(args.resource_type, args.props):
        ud = _UserData(prop, text)
        for i, path, encoding, data in ud.files:
            where = f"{prop}: write_files[{i}] ({path})"
            if MUNGE_PATH.search(path):
                report(f"{prop}: write_files[{i}] writes {path}: the munge key must never be in "
                       "user-data; the controller makes it at first boot and fab copies it over SSH")
            elif encoding in ENCODINGS and data is None:
                report(f"{where}: content is not valid {encoding}; user-data may only carry files "
                       "the policy can read")
            elif data is not None and _is_binary(data):
                report(f"{where} holds {len(data)} bytes of binary data, like a key file: keep keys "
                       "out of user-data")
        for where, body in ud.decoded_texts():
            for blob in _key_blobs(body):
                report(f"{where} carries a {len(blob)}-character encoded blob ({blob[:12]}...), the size "
                       "of a munge key or other secret: keep secrets out of user-data (it is readable "
                       "from the instance metadata and stored in Pulumi state)")


def _is_binary(data: bytes) -> bool:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return "\x00" in text


# ------------------------------------------------------ stack policies

def _refers_to(res: Any, prop: str, value: Any, target: Any, target_keys: Sequence[str] = ("id",)) -> bool:
    """Does `res.props[prop]` (whose value is `value`, None when unknown) point at `target`?
    By value when both sides are known, else by the engine's property dependencies."""
    if value is not None:
        for key in target_keys:
            ok, tval = _known(target.props, key)
            if ok and tval is not None and tval in _list(value):
                return True
    deps = res.property_dependencies.get(prop, []) if res.property_dependencies else []
    return any(d.urn == target.urn for d in deps)


def _attached_interfaces(inst: Any, enis: list) -> list:
    """The network interfaces among `enis` that `inst` is launched with."""
    attached = []
    for prop in ("primaryNetworkInterface", "networkInterfaces"):
        ok, val = _known(inst.props, prop)
        ids = [] if not ok else [
            _known(item, "networkInterfaceId")[1] for item in _list(val) if isinstance(item, Mapping)
        ]
        for eni in enis:
            if eni not in attached and _refers_to(inst, prop, [i for i in ids if i] or None, eni):
                attached.append(eni)
    return attached


def _efa_instances(resources: list) -> list[tuple[Any, list]]:
    """(instance, its EFA interfaces) for every instance launched with an EFA interface
    (`efa`, or `efa-only` on the extra network cards)."""
    enis = [r for r in resources
            if r.resource_type == NETWORK_INTERFACE and _known(r.props, "interfaceType")[1] in EFA_TYPES]
    out = []
    for inst in (r for r in resources if r.resource_type == INSTANCE):
        attached = _attached_interfaces(inst, enis)
        if attached:
            out.append((inst, attached))
    return out


def _gpu_instances(resources: list) -> list[tuple[Any, list]]:
    """(instance, all its interfaces) for every GPU node: tagged Role=gpu, or launched with
    an EFA interface (the GPU nodes of this project, whatever a refactor renames)."""
    enis = [r for r in resources if r.resource_type == NETWORK_INTERFACE]
    efa = {inst.urn for inst, _ in _efa_instances(resources)}
    out = []
    for inst in (r for r in resources if r.resource_type == INSTANCE):
        _, role = _known(inst.props, "tags", "Role")
        if role == "gpu" or inst.urn in efa:
            out.append((inst, _attached_interfaces(inst, enis)))
    return out


def check_gpu_nodes_no_public_ip(args: StackValidationArgs, report: ReportViolation) -> None:
    resources = args.resources
    subnets = [r for r in resources if r.resource_type == SUBNET]
    addresses = [(r, "networkInterface", "instance") for r in resources if r.resource_type == EIP] + \
                [(r, "networkInterfaceId", "instanceId") for r in resources if r.resource_type == EIP_ASSOCIATION]
    reported: set[str] = set()
    for inst, enis in _gpu_instances(resources):
        ok, public = _known(inst.props, "associatePublicIpAddress")
        if ok and _truthy(public):
            report(f"{inst.name} is a GPU node with associatePublicIpAddress true: GPU nodes take no "
                   "public address; launch them in the private subnet, where they reach the internet "
                   "through the NAT gateway", inst.urn)
        for addr, eni_prop, inst_prop in addresses:
            _, eni_id = _known(addr.props, eni_prop)
            _, inst_id = _known(addr.props, inst_prop)
            on_eni = next((e for e in enis if _refers_to(addr, eni_prop, eni_id, e)), None)
            if on_eni is not None or _refers_to(addr, inst_prop, inst_id, inst):
                where = f"interface {on_eni.name} of " if on_eni is not None else ""
                report(f"Elastic IP {addr.name} is attached to {where}GPU node {inst.name}: GPU nodes "
                       "take no public address; remove it (outbound traffic goes through the NAT "
                       "gateway, SSH through the controller)", addr.urn)
        for subnet in subnets:
            if subnet.urn in reported:
                continue
            _, inst_subnet = _known(inst.props, "subnetId")
            inside = _refers_to(inst, "subnetId", inst_subnet, subnet) or any(
                _refers_to(e, "subnetId", _known(e.props, "subnetId")[1], subnet) for e in enis)
            ok, maps = _known(subnet.props, "mapPublicIpOnLaunch")
            if inside and ok and _truthy(maps):
                reported.add(subnet.urn)
                report(f"subnet {subnet.name} of GPU node {inst.name} has mapPublicIpOnLaunch true: set "
                       "map_public_ip_on_launch=False on the GPU nodes' subnet", subnet.urn)


def _placed_elsewhere(inst: Any) -> bool:
    """An instance the stack's cluster placement group cannot or need not hold: a spot instance that
    stops or hibernates on interruption ("You can't launch a Spot Instance that is configured to stop
    or hibernate on interruption in a placement group": EC2 User Guide, "Placement group rules and
    limitations"), or one launched into a capacity reservation, which places it."""
    _, behaviour = _known(inst.props, "instanceMarketOptions", "spotOptions", "instanceInterruptionBehavior")
    _, target = _known(inst.props, "capacityReservationSpecification", "capacityReservationTarget")
    return behaviour in ("stop", "hibernate") or bool(target)


def check_efa_placement_group(args: StackValidationArgs, report: ReportViolation) -> None:
    groups = [r for r in args.resources if r.resource_type == PLACEMENT_GROUP]
    efa = [(inst, enis) for inst, enis in _efa_instances(args.resources) if not _placed_elsewhere(inst)]
    used: dict[str, list[str]] = {}
    for inst, _ in efa:
        ok, value = _known(inst.props, "placementGroup")
        matches = [g for g in groups if _refers_to(inst, "placementGroup", value if ok else None, g,
                                                      ("name", "id", "placementGroupId"))]
        if not matches:
            if ok and not value:
                report(f"{inst.name} has an EFA interface but no placementGroup: launch every EFA node "
                       "in one placement group with strategy \"cluster\"", inst.urn)
                continue
            if ok:
                report(f"{inst.name} is in placement group {value!r}, which this stack does not declare: "
                       "declare one aws.ec2.PlacementGroup with strategy \"cluster\" for the EFA nodes",
                       inst.urn)
            continue  # unknown and no dependency: decided during `pulumi up`
        group = matches[0]
        strategy = _get(group.props, "strategy")
        if strategy != "cluster":
            report(f"{inst.name} is in placement group {group.name} whose strategy is {strategy!r}: EFA "
                   "nodes need strategy \"cluster\"", inst.urn)
        used.setdefault(group.urn, []).append(inst.name)
    if len(used) > 1:
        split = "; ".join(f"{urn.split('::')[-1]}: {', '.join(names)}" for urn, names in used.items())
        report(f"EFA nodes are split across placement groups ({split}): put them all in one cluster "
               "placement group")


def _self_rule(resources: list, sg: Any, direction: str) -> bool:
    """Does the stack give `sg` an all-protocol rule to/from itself in `direction`?"""
    ok, inline = _known(sg.props, direction)
    for rule in _list(inline) if ok else []:
        if isinstance(rule, Mapping) and _get(rule, "self") is True and \
                str(_get(rule, "protocol")).lower() in ALL_PROTOCOLS:
            return True
    vpc_type = VPC_EGRESS if direction == "egress" else VPC_INGRESS
    for r in resources:
        if r.resource_type == vpc_type:
            okp, proto = _known(r.props, "ipProtocol")
            if not okp or str(proto).lower() not in ALL_PROTOCOLS:
                continue
            _, owner = _known(r.props, "securityGroupId")
            _, peer = _known(r.props, "referencedSecurityGroupId")
            if _refers_to(r, "securityGroupId", owner, sg) and _refers_to(r, "referencedSecurityGroupId", peer, sg):
                return True
        elif r.resource_type == SG_RULE and _get(r.props, "type") == direction:
            if str(_get(r.props, "protocol")).lower() not in ALL_PROTOCOLS:
                continue
            _, owner = _known(r.props, "securityGroupId")
            if not _refers_to(r, "securityGroupId", owner, sg):
                continue
            _, source = _known(r.props, "sourceSecurityGroupId")
            if _get(r.props, "self") is True or _refers_to(r, "sourceSecurityGroupId", source, sg):
                return True
    return False


def check_efa_self_rules(args: StackValidationArgs, report: ReportViolation) -> None:
    groups = [r for r in args.resources if r.resource_type == SECURITY_GROUP]
    seen = set()
    for inst, enis in _efa_instances(args.resources):
        for eni in enis:
            ok, ids = _known(eni.props, "securityGroups")
            for sg in groups:
                if sg.urn in seen or not _refers_to(eni, "securityGroups", ids if ok else None, sg):
                    continue
                seen.add(sg.urn)
                for direction, word in (("egress", "to"), ("ingress", "from")):
                    if not _self_rule(args.resources, sg, direction):
                        report(f"security group {sg.name} of EFA node {inst.name} has no all-traffic {direction} "
                               f"rule {word} itself: EFA needs both (an egress to 0.0.0.0/0 does not cover "
                               "EFA); add a rule with referenced_security_group_id = the group's own id",
                               sg.urn)


# ---------------------------------------------------- power-save role

# The EC2 actions that stop and start instances (what Slurm's power programs need).
STOP_START_ACTIONS = ("ec2:stopinstances", "ec2:startinstances")
# The tags that name one cluster's instances: Cluster (infra/power_role.py conditions on it always) and
# the stack's own tag (cluster/facts.py STACK_TAG, added where the stack is known). Role=gpu or any other
# tag is on the GPU nodes of every stack: it scopes nothing. Compared without case: whether IAM then
# matches the instance's Cluster tag or no tag at all, the statement allows no instance outside the scope.
SCOPING_TAG_KEYS = ("cluster", "slurm-gpu:stack")
_SCOPING_KEYS_RE = "|".join(map(re.escape, SCOPING_TAG_KEYS))
TAG_CONDITION_KEY = re.compile(rf"^(?:aws|ec2):resourcetag/({_SCOPING_KEYS_RE})$", re.IGNORECASE)
# A StringLike value made only of wildcards ("*", "?*", "**"...) matches any tag value of its length.
_WILDCARDS_ONLY = re.compile(r"^[*?]+$")


def _policy_documents(resource_type: str, props: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(where, parsed document) of every IAM policy document the resource carries."""
    found = []
    if resource_type in (IAM_ROLE_POLICY, IAM_POLICY):
        found.append(("policy", _get(props, "policy")))
    elif resource_type == IAM_ROLE:
        for i, inline in enumerate(_list(_get(props, "inlinePolicies"))):
            found.append((f"inlinePolicies[{i}].policy", _get(inline, "policy")))
    out = []
    for where, doc in found:
        if isinstance(doc, str):
            try:
                doc = json.loads(doc)
            except ValueError:
                continue
        if isinstance(doc, Mapping):
            out.append((where, doc))
    return out


# Condition operators that hold only when the request carries the tag and it matches. Not `...IfExists`:
# "If the key is not present, evaluate the condition element as true", so StringEqualsIfExists matches
# an untagged instance; not a set qualifier (ForAllValues:... is true for a missing key either).
# https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_elements_condition_operators.html#Conditions_IfExists
# https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_condition-single-vs-multi-valued-context-keys.html
TAG_MATCH_OPERATORS = ("stringequals", "stringequalsignorecase", "stringlike")


def _tag_scoped(statement: Mapping[str, Any]) -> bool:
    """Does the statement's Condition require the Cluster or the stack tag (SCOPING_TAG_KEYS) to be
    present and equal a value (not "*", nor under StringLike a value of wildcards only)?"""
    conditions = _get(statement, "Condition")
    if not isinstance(conditions, Mapping):
        return False
    for operator, tests in conditions.items():
        op = str(operator).lower()
        if op not in TAG_MATCH_OPERATORS or not isinstance(tests, Mapping):
            continue
        for key, value in tests.items():
            values = [str(v) for v in _list(value)]
            if not TAG_CONDITION_KEY.match(str(key)) or not values:
                continue
            if all(v and v != "*" and not (op == "stringlike" and _WILDCARDS_ONLY.match(v)) for v in values):
                return True
    return False


def check_power_role_tag_scoped(args: ResourceValidationArgs, report: ReportViolation) -> None:
    for where, doc in _policy_documents(args.resource_type, args.props):
        for i, st in enumerate(_list(_get(doc, "Statement"))):
            if not isinstance(st, Mapping) or _get(st, "Effect") != "Allow":
                continue
            at = f"{where} Statement[{i}]"
            if _get(st, "NotAction") is not None:
                report(f"{at} uses NotAction (it allows everything else): list the actions it allows")
            actions = [str(a) for a in _list(_get(st, "Action"))]
            wild = [a for a in actions if "*" in a or "?" in a]
            if wild:
                report(f"{at} allows wildcard action(s) {', '.join(wild)}: name each action "
                       "(the power-save role needs ec2:StopInstances, ec2:StartInstances, ec2:DescribeInstances)")
            stop_start = sorted({want for a in actions for want in STOP_START_ACTIONS
                                 if fnmatch.fnmatchcase(want, a.lower())})
            if stop_start and not _tag_scoped(st):
                report(f"{at} allows {' and '.join(stop_start)} without a resource-tag condition: add "
                       "Condition StringEquals aws:ResourceTag/Cluster = <clusterName> (and Role = gpu) so "
                       "it can stop and start this cluster's GPU nodes only")


def _grant_is_for_aws_resource(statement: Mapping[str, Any]) -> bool:
    """Is the statement limited to grants an AWS service creates for its resources?"""
    conditions = _get(statement, "Condition")
    if not isinstance(conditions, Mapping):
        return False
    for operator, tests in conditions.items():
        if str(operator).lower() != "bool" or not isinstance(tests, Mapping):
            continue
        for key, value in tests.items():
            if str(key).lower() == "kms:grantisforawsresource" and \
                    [str(v).lower() for v in _list(value)] == ["true"]:
                return True
    return False


def check_kms_use_names_its_key(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """KMS permissions (the power-save role's on the root volumes' key) name the key itself,
    and kms:CreateGrant only for grants AWS services make for their resources."""
    for where, doc in _policy_documents(args.resource_type, args.props):
        for i, st in enumerate(_list(_get(doc, "Statement"))):
            if not isinstance(st, Mapping) or _get(st, "Effect") != "Allow":
                continue
            at = f"{where} Statement[{i}]"
            actions = [str(a).lower() for a in _list(_get(st, "Action"))]
            kms = [a for a in actions if a.startswith("kms:")]
            if not kms:
                continue
            resources = [str(r) for r in _list(_get(st, "Resource"))]
            keys = [r for r in resources if re.fullmatch(r"arn:aws[a-z-]*:kms:[^:*]+:\d{12}:key/[^*?]+", r)]
            if not resources or keys != resources:
                report(f"{at} allows {', '.join(kms)} on {', '.join(resources) or 'no named resource'}: "
                       "name the KMS key's ARN (arn:aws:kms:REGION:ACCOUNT:key/ID), never * or an alias")
            if any(fnmatch.fnmatchcase("kms:creategrant", a) for a in kms) and not _grant_is_for_aws_resource(st):
                report(f"{at} allows kms:CreateGrant without Condition Bool kms:GrantIsForAWSResource = true: "
                       "only EC2 may create grants on the key, for the instance's volumes")


# --------------------------------------------------------------- the pack

def _resource(name: str, description: str, check: Callable,
              config_schema: PolicyConfigSchema | None = None) -> ResourceValidationPolicy:
    return ResourceValidationPolicy(name=name, description=description, validate=check,
                                    enforcement_level=EnforcementLevel.MANDATORY, config_schema=config_schema)


def _stack(name: str, description: str, check: Callable) -> StackValidationPolicy:
    return StackValidationPolicy(name=name, description=description, validate=check,
                                 enforcement_level=EnforcementLevel.MANDATORY)


def policies() -> list:
    """Every policy of the pack, each mandatory (a violation stops preview and up)."""
    return [
        _resource("ssh-not-open-to-internet",
                  "SSH (port 22, a range holding it, or all traffic) is never open to 0.0.0.0/0 or ::/0.",
                  check_ssh_not_open, OVERRIDE_SCHEMA),
        _resource("ssh-source-is-narrow",
                  "SSH comes from at most a /16 (IPv6: a /48), never a loopback or link-local range.",
                  check_ssh_source_is_narrow, OVERRIDE_SCHEMA),
        _resource("only-ssh-from-outside",
                  "The only ingress from an address range is SSH (tcp 22); all else comes from the group.",
                  check_no_other_cidr_ingress),
        _resource("instances-require-imdsv2",
                  "EC2 instances require IMDSv2 (metadataOptions.httpTokens = \"required\").",
                  check_imdsv2),
        _resource("volumes-encrypted",
                  "Root and EBS volumes are encrypted.",
                  check_volumes_encrypted),
        _resource("user-data-has-no-munge-key",
                  "User-data writes no munge key and carries no key-sized encoded blob.",
                  check_user_data_has_no_munge_key),
        _resource("no-private-key-material",
                  "No resource property holds private key material (\"PRIVATE KEY\").",
                  check_no_private_key),
        _resource("key-pair-public-key-only",
                  "The EC2 key pair is given an OpenSSH public key, nothing else.",
                  check_key_pair_public),
        _resource("power-save-role-is-tag-scoped",
                  "IAM policies allow ec2:StopInstances/StartInstances only with a resource-tag condition on "
                  "the Cluster or slurm-gpu:stack tag (a value, not wildcards), and no wildcard actions.",
                  check_power_role_tag_scoped),
        _resource("kms-use-names-its-key",
                  "IAM policies allow KMS actions only on named key ARNs, and kms:CreateGrant only with "
                  "kms:GrantIsForAWSResource.",
                  check_kms_use_names_its_key),
        _stack("efa-nodes-share-cluster-placement-group",
               "Instances with an EFA interface share one placement group with strategy \"cluster\".",
               check_efa_placement_group),
        _stack("gpu-nodes-have-no-public-ip",
               "GPU nodes have no public IP: no associatePublicIpAddress, no Elastic IP on them or their "
               "interfaces, and their subnet does not map public IPs on launch.",
               check_gpu_nodes_no_public_ip),
        _stack("efa-security-group-self-rules",
               "The security group of EFA interfaces keeps all-traffic ingress and egress rules to itself.",
               check_efa_self_rules),
    ]
