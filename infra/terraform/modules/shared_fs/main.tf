# The filesystem every node of the Sluice cluster mounts at the same path. Sluice hands its
# actors some files as paths: the starting policy folder and the vLLM and inductor caches
# (under the config's `cache`) and the final policy folder (under `root`). With the clone the
# driver runs in under the shared mount, those paths exist on every node.
#
# Access is closed three ways: the mount targets' security group takes NFS only from the
# cluster's security groups; the file system policy refuses connections without TLS, and
# since it grants nothing to anonymous clients, only IAM principals whose own policies allow
# elasticfilesystem:ClientMount (the node roles, modules/iam) can mount; and the nodes mount
# through an access point that makes every operation run as the `sluice` user.

# --- the file system ------------------------------------------------------------------------

resource "aws_efs_file_system" "this" {
  creation_token = "${var.name}-shared"
  encrypted      = true
  kms_key_id     = var.kms_key_arn

  # Elastic throughput, not bursting: bursting scales its baseline with the bytes stored
  # (50 KiB/s per GiB), and this filesystem stores little (a few policy folders and caches)
  # but is read in bursts: every rollout worker loads the policy folder at once when a run
  # starts or a node joins, and the trainer writes a whole policy at the end. A small
  # bursting filesystem can run out of credits in such a burst and fall to a trickle;
  # elastic scales with demand and bills the bytes moved, which for this pattern is small.
  performance_mode = "generalPurpose"
  throughput_mode  = "elastic"

  # Policy folders and caches of old runs go to Infrequent Access after a while and come
  # back on their first read (a later run reusing a cached starting policy).
  lifecycle_policy {
    transition_to_ia = var.transition_to_ia
  }

  lifecycle_policy {
    transition_to_primary_storage_class = "AFTER_1_ACCESS"
  }

  tags = merge(var.tags, { Name = "${var.name}-shared" })
}

# AWS Backup is opt-in: the filesystem holds rebuildable caches, the cloned code and run
# folders, while the durable state of a run (checkpoints, ledger, trajectories, the
# registered policy's artifacts) goes to S3.
resource "aws_efs_backup_policy" "this" {
  file_system_id = aws_efs_file_system.this.id

  backup_policy {
    status = var.enable_backup ? "ENABLED" : "DISABLED"
  }
}

# Refuse every connection without TLS. The policy allows nothing, so it also replaces EFS's
# default policy (full access for any anonymous client that reaches a mount target): what a
# client may do now comes only from its IAM identity policy, and efs-utils' `iam` mount
# option is what presents one.
data "aws_iam_policy_document" "tls_only" {
  statement {
    sid       = "DenyConnectionsWithoutTls"
    effect    = "Deny"
    actions   = ["*"]
    resources = [aws_efs_file_system.this.arn]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_efs_file_system_policy" "this" {
  file_system_id = aws_efs_file_system.this.id
  policy         = data.aws_iam_policy_document.tls_only.json
}

# --- the way in: mount targets and their security group -------------------------------------

resource "aws_security_group" "this" {
  name        = "${var.name}-shared-fs"
  description = "Sluice shared filesystem mount targets: NFS from the cluster nodes only"
  vpc_id      = var.vpc_id

  tags = merge(var.tags, { Name = "${var.name}-shared-fs" })
}

# NFS (2049, NFSv4.1; efs-utils' TLS tunnel connects to the same port) from each of the
# cluster's security groups, and nothing else: no CIDR range. The mount targets answer and
# never open a connection, so the group has no egress rule (Terraform removes AWS's default
# allow-all one).
resource "aws_vpc_security_group_ingress_rule" "nfs" {
  for_each = var.client_security_group_ids

  security_group_id            = aws_security_group.this.id
  referenced_security_group_id = each.value
  ip_protocol                  = "tcp"
  from_port                    = 2049
  to_port                      = 2049
  description                  = "NFS over TLS from the ${each.key} nodes"
}

# One per private subnet (EFS allows one per availability zone), so a node mounts through
# the target in its own zone: no cross-zone traffic, and a zone outage takes only its nodes.
resource "aws_efs_mount_target" "this" {
  count = length(var.subnet_ids)

  file_system_id  = aws_efs_file_system.this.id
  subnet_id       = var.subnet_ids[count.index]
  security_groups = [aws_security_group.this.id]
}

# Every operation through this access point runs as var.owner_uid/var.owner_gid, whatever
# user the client is (root included), inside var.root_directory, which EFS creates owned by
# that user on first use. The nodes' `sluice` user has the same IDs, so files look the same
# from every node and root on a node needs no root access to the filesystem.
resource "aws_efs_access_point" "sluice" {
  file_system_id = aws_efs_file_system.this.id

  posix_user {
    uid = var.owner_uid
    gid = var.owner_gid
  }

  root_directory {
    path = var.root_directory

    creation_info {
      owner_uid   = var.owner_uid
      owner_gid   = var.owner_gid
      permissions = "0755"
    }
  }

  tags = merge(var.tags, { Name = "${var.name}-sluice" })
}
