# Two instance roles. Both may read and write objects under <bucket>/<prefix>/ (and list only
# that prefix), use the KMS key only through S3 and SSM, read the Ray token parameter, and
# mount the shared filesystem read-write through its access point; only the head may write
# the token parameter. No statement grants an action on every resource.

data "aws_region" "current" {}
data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  partition           = data.aws_partition.current.partition
  token_parameter_arn = "arn:${local.partition}:ssm:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:parameter${var.ray_token_parameter_name}"
  s3_service          = "s3.${data.aws_region.current.name}.amazonaws.com"
  ssm_service         = "ssm.${data.aws_region.current.name}.amazonaws.com"
}

data "aws_iam_policy_document" "ec2_assume" {
  statement {
    sid     = "Ec2Assume"
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "storage" {
  statement {
    sid       = "ListOnlyThePrefix"
    actions   = ["s3:ListBucket", "s3:ListBucketVersions"]
    resources = [var.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.prefix, "${var.prefix}/*"]
    }
  }

  statement {
    sid       = "LocateTheBucket"
    actions   = ["s3:GetBucketLocation", "s3:ListBucketMultipartUploads"]
    resources = [var.bucket_arn]
  }

  statement {
    sid = "ReadWriteObjectsUnderThePrefix"
    actions = [
      "s3:GetObject",
      "s3:GetObjectVersion",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = ["${var.bucket_arn}/${var.prefix}/*"]
  }

  statement {
    sid       = "UseTheKeyThroughS3"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [var.kms_key_arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = [local.s3_service]
    }
  }
}

data "aws_iam_policy_document" "ray_token_read" {
  statement {
    sid       = "ReadTheRayToken"
    actions   = ["ssm:GetParameter"]
    resources = [local.token_parameter_arn]
  }

  statement {
    sid       = "DecryptTheRayTokenThroughSsm"
    actions   = ["kms:Decrypt"]
    resources = [var.kms_key_arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = [local.ssm_service]
    }
  }
}

data "aws_iam_policy_document" "ray_token_write" {
  statement {
    sid       = "WriteTheRayToken"
    actions   = ["ssm:PutParameter"]
    resources = [local.token_parameter_arn]
  }

  statement {
    sid       = "EncryptTheRayTokenThroughSsm"
    actions   = ["kms:Encrypt", "kms:GenerateDataKey"]
    resources = [var.kms_key_arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = [local.ssm_service]
    }
  }
}

# The shared filesystem's policy grants nothing to anyone (it only refuses connections
# without TLS), so mounting takes these: efs-utils' `iam` option signs the mount with the
# instance role. Mount and write, only through the access point (which runs everything as
# the sluice user) and only through a mount target; no ClientRootAccess, which nothing needs
# when the access point fixes the identity.
data "aws_iam_policy_document" "shared_fs" {
  statement {
    sid       = "MountTheSharedFilesystemThroughItsAccessPoint"
    actions   = ["elasticfilesystem:ClientMount", "elasticfilesystem:ClientWrite"]
    resources = [var.shared_file_system_arn]

    condition {
      test     = "StringEquals"
      variable = "elasticfilesystem:AccessPointArn"
      values   = [var.shared_access_point_arn]
    }

    condition {
      test     = "Bool"
      variable = "elasticfilesystem:AccessedViaMountTarget"
      values   = ["true"]
    }
  }
}

resource "aws_iam_role" "head" {
  name               = "${var.name}-ray-head"
  description        = "Sluice ${var.name}: Ray head, Prefect worker, MLflow"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json

  tags = var.tags
}

resource "aws_iam_role" "worker" {
  name               = "${var.name}-ray-worker"
  description        = "Sluice ${var.name}: spot GPU Ray workers"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json

  tags = var.tags
}

resource "aws_iam_role_policy" "head_storage" {
  name   = "sluice-storage"
  role   = aws_iam_role.head.id
  policy = data.aws_iam_policy_document.storage.json
}

resource "aws_iam_role_policy" "worker_storage" {
  name   = "sluice-storage"
  role   = aws_iam_role.worker.id
  policy = data.aws_iam_policy_document.storage.json
}

resource "aws_iam_role_policy" "head_token_read" {
  name   = "ray-token-read"
  role   = aws_iam_role.head.id
  policy = data.aws_iam_policy_document.ray_token_read.json
}

resource "aws_iam_role_policy" "head_token_write" {
  name   = "ray-token-write"
  role   = aws_iam_role.head.id
  policy = data.aws_iam_policy_document.ray_token_write.json
}

resource "aws_iam_role_policy" "worker_token_read" {
  name   = "ray-token-read"
  role   = aws_iam_role.worker.id
  policy = data.aws_iam_policy_document.ray_token_read.json
}

resource "aws_iam_role_policy" "head_shared_fs" {
  name   = "shared-fs-mount"
  role   = aws_iam_role.head.id
  policy = data.aws_iam_policy_document.shared_fs.json
}

resource "aws_iam_role_policy" "worker_shared_fs" {
  name   = "shared-fs-mount"
  role   = aws_iam_role.worker.id
  policy = data.aws_iam_policy_document.shared_fs.json
}

resource "aws_iam_role_policy_attachment" "head_ssm" {
  count = var.enable_ssm_session_manager ? 1 : 0

  role       = aws_iam_role.head.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_role_policy_attachment" "worker_ssm" {
  count = var.enable_ssm_session_manager ? 1 : 0

  role       = aws_iam_role.worker.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "head" {
  name = "${var.name}-ray-head"
  role = aws_iam_role.head.name

  tags = var.tags
}

resource "aws_iam_instance_profile" "worker" {
  name = "${var.name}-ray-worker"
  role = aws_iam_role.worker.name

  tags = var.tags
}
