# An example Sluice cluster on AWS: network, storage, IAM, the shared filesystem and the Ray
# cluster, wired together.
# `terraform apply` here, then follow ../../README.md ("Use") and ../../../../docs/cluster.md.

locals {
  wanted_azs = length(var.availability_zones) > 0 ? var.availability_zones : [for suffix in ["a", "b", "c"] : "${var.region}${suffix}"]
}

# Looked up by name: a zone that does not exist or is not available fails the plan, and the
# set never grows by itself when AWS opens a new zone.
data "aws_availability_zones" "chosen" {
  state = "available"

  filter {
    name   = "zone-name"
    values = local.wanted_azs
  }
}

# Public SSM parameters AWS keeps pointing at the newest images.
data "aws_ssm_parameter" "head_ami" {
  count = var.head_ami_id == "" ? 1 : 0
  name  = "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"
}

data "aws_ssm_parameter" "worker_ami" {
  count = var.worker_ami_id == "" ? 1 : 0
  name  = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-amazon-linux-2023/latest/ami-id"
}

locals {
  azs                 = data.aws_availability_zones.chosen.names
  head_ami_id         = var.head_ami_id != "" ? var.head_ami_id : data.aws_ssm_parameter.head_ami[0].insecure_value
  worker_ami_id       = var.worker_ami_id != "" ? var.worker_ami_id : data.aws_ssm_parameter.worker_ami[0].insecure_value
  ray_token_parameter = "/sluice/${var.name}/ray-auth-token"
}

module "storage" {
  source = "../../modules/storage"

  name          = var.name
  bucket_name   = var.bucket_name
  prefix        = var.storage_prefix
  force_destroy = var.force_destroy_bucket
}

module "network" {
  source = "../../modules/network"

  name               = var.name
  vpc_cidr           = var.vpc_cidr
  availability_zones = local.azs
  kms_key_arn        = module.storage.kms_key_arn
}

module "iam" {
  source = "../../modules/iam"

  name                     = var.name
  bucket_arn               = module.storage.bucket_arn
  prefix                   = module.storage.prefix
  kms_key_arn              = module.storage.kms_key_arn
  ray_token_parameter_name = local.ray_token_parameter
  shared_file_system_arn   = module.shared_fs.file_system_arn
  shared_access_point_arn  = module.shared_fs.access_point_arn
}

# Mounted by every node at var.shared_mount_path: the folder Sluice is cloned into and run
# from, so that its `runs` and `.cache` are the same files on every node.
module "shared_fs" {
  source = "../../modules/shared_fs"

  name        = var.name
  vpc_id      = module.network.vpc_id
  subnet_ids  = module.network.private_subnet_ids
  kms_key_arn = module.storage.kms_key_arn
  client_security_group_ids = {
    head   = module.ray_cluster.head_security_group_id
    worker = module.ray_cluster.worker_security_group_id
  }
  owner_uid     = var.sluice_uid
  owner_gid     = var.sluice_uid
  enable_backup = var.shared_fs_backup
}

module "ray_cluster" {
  source = "../../modules/ray_cluster"

  name                         = var.name
  vpc_id                       = module.network.vpc_id
  private_subnet_ids           = module.network.private_subnet_ids
  head_ami_id                  = local.head_ami_id
  worker_ami_id                = local.worker_ami_id
  head_instance_type           = var.head_instance_type
  worker_groups                = var.worker_groups
  head_instance_profile_name   = module.iam.head_instance_profile_name
  worker_instance_profile_name = module.iam.worker_instance_profile_name
  kms_key_arn                  = module.storage.kms_key_arn
  ray_token_parameter_name     = local.ray_token_parameter
  storage_url                  = module.storage.storage_url
  head_pip_packages            = var.head_pip_packages
  worker_pip_packages          = var.worker_pip_packages
  mlflow_tracking_uri          = var.mlflow_tracking_uri
  prefect_api_url              = var.prefect_api_url
  operator_cidr_blocks         = var.operator_cidr_blocks
  shared_file_system_id        = module.shared_fs.file_system_id
  shared_access_point_id       = module.shared_fs.access_point_id
  shared_fs_security_group_id  = module.shared_fs.security_group_id
  shared_mount_path            = var.shared_mount_path
  sluice_uid                   = var.sluice_uid
}
