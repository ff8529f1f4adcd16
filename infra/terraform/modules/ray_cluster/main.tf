# A Ray cluster for Sluice: one on-demand head (Ray GCS and dashboard, the Prefect worker that
# runs the flows, and MLflow and the Prefect server unless existing ones are given) and spot
# GPU worker groups that install Sluice and join the head at boot. Every node mounts the
# shared filesystem (modules/shared_fs) at var.shared_mount_path before Ray starts. Every
# node sits in a private subnet; the services are reachable from the cluster itself, from
# var.operator_cidr_blocks if given, and through SSM port forwarding.

data "aws_region" "current" {}

locals {
  # The ports Sluice's services listen on, opened only inside the cluster and to operators.
  ports = {
    ray_gcs       = 6379
    ray_client    = 10001
    ray_dashboard = 8265
    mlflow        = 5000
    prefect       = 4200
  }
  # What operators may reach from var.operator_cidr_blocks (the GCS stays cluster-only).
  operator_ports = ["ray_client", "ray_dashboard", "mlflow", "prefect"]
  operator_rules = {
    for pair in setproduct(var.operator_cidr_blocks, local.operator_ports) :
    "${pair[1]}-${pair[0]}" => { cidr = pair[0], port = local.ports[pair[1]], service = pair[1] }
  }

  run_mlflow  = var.mlflow_tracking_uri == ""
  run_prefect = var.prefect_api_url == ""
  head_ip     = aws_instance.head.private_ip
  mlflow_uri  = local.run_mlflow ? "http://${local.head_ip}:${local.ports.mlflow}" : var.mlflow_tracking_uri
  prefect_api = local.run_prefect ? "http://${local.head_ip}:${local.ports.prefect}/api" : var.prefect_api_url
  ebs_kms_key = var.ebs_kms_key_arn == "" ? null : var.ebs_kms_key_arn
}

# --- security groups --------------------------------------------------------------------

resource "aws_security_group" "head" {
  name        = "${var.name}-ray-head"
  description = "Sluice Ray head: cluster traffic, operator ranges on service ports"
  vpc_id      = var.vpc_id

  tags = merge(var.tags, { Name = "${var.name}-ray-head" })
}

resource "aws_security_group" "worker" {
  name        = "${var.name}-ray-worker"
  description = "Sluice spot Ray workers: cluster traffic only"
  vpc_id      = var.vpc_id

  tags = merge(var.tags, { Name = "${var.name}-ray-worker" })
}

# Ray's raylets, object managers and worker processes talk on many dynamic ports, and NCCL
# between trainers too, so members of the cluster may reach each other on every port.
resource "aws_vpc_security_group_ingress_rule" "head_from_head" {
  security_group_id            = aws_security_group.head.id
  referenced_security_group_id = aws_security_group.head.id
  ip_protocol                  = "-1"
  description                  = "Ray traffic within the head"
}

resource "aws_vpc_security_group_ingress_rule" "head_from_workers" {
  security_group_id            = aws_security_group.head.id
  referenced_security_group_id = aws_security_group.worker.id
  ip_protocol                  = "-1"
  description                  = "Ray GCS, object transfer, MLflow and Prefect from the workers"
}

resource "aws_vpc_security_group_ingress_rule" "worker_from_head" {
  security_group_id            = aws_security_group.worker.id
  referenced_security_group_id = aws_security_group.head.id
  ip_protocol                  = "-1"
  description                  = "Ray scheduling and object transfer from the head"
}

resource "aws_vpc_security_group_ingress_rule" "worker_from_workers" {
  security_group_id            = aws_security_group.worker.id
  referenced_security_group_id = aws_security_group.worker.id
  ip_protocol                  = "-1"
  description                  = "Ray object transfer and NCCL between workers"
}

resource "aws_vpc_security_group_ingress_rule" "operators" {
  for_each = local.operator_rules

  security_group_id = aws_security_group.head.id
  cidr_ipv4         = can(regex(":", each.value.cidr)) ? null : each.value.cidr
  cidr_ipv6         = can(regex(":", each.value.cidr)) ? each.value.cidr : null
  ip_protocol       = "tcp"
  from_port         = each.value.port
  to_port           = each.value.port
  description       = "Operators to ${each.value.service}"
}

# Outbound: HTTPS anywhere (PyPI, the AWS APIs, SSM, model hubs) through the NAT gateway,
# and everything to the other cluster members. DNS, NTP and the metadata service are
# link-local and not filtered by security groups.
resource "aws_vpc_security_group_egress_rule" "head_https" {
  security_group_id = aws_security_group.head.id
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  description       = "HTTPS out: package index, AWS APIs, SSM"
}

resource "aws_vpc_security_group_egress_rule" "head_to_cluster" {
  for_each = { head = aws_security_group.head.id, worker = aws_security_group.worker.id }

  security_group_id            = aws_security_group.head.id
  referenced_security_group_id = each.value
  ip_protocol                  = "-1"
  description                  = "Ray traffic to the ${each.key} nodes"
}

resource "aws_vpc_security_group_egress_rule" "worker_https" {
  security_group_id = aws_security_group.worker.id
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  description       = "HTTPS out: package index, AWS APIs, SSM, model hubs"
}

resource "aws_vpc_security_group_egress_rule" "worker_to_cluster" {
  for_each = { head = aws_security_group.head.id, worker = aws_security_group.worker.id }

  security_group_id            = aws_security_group.worker.id
  referenced_security_group_id = each.value
  ip_protocol                  = "-1"
  description                  = "Ray traffic to the ${each.key} nodes"
}

# NFS (over efs-utils' TLS tunnel) to the shared filesystem's mount targets, whose own group
# takes it only from these two groups (modules/shared_fs).
resource "aws_vpc_security_group_egress_rule" "nfs" {
  for_each = { head = aws_security_group.head.id, worker = aws_security_group.worker.id }

  security_group_id            = each.value
  referenced_security_group_id = var.shared_fs_security_group_id
  ip_protocol                  = "tcp"
  from_port                    = 2049
  to_port                      = 2049
  description                  = "NFS over TLS from the ${each.key} nodes to the shared filesystem"
}

# --- the Ray auth token -------------------------------------------------------------------

# Ray 2.60 clusters authenticate every RPC with a shared token. The head generates it at first
# boot (it never passes through Terraform or its state) and writes it here; workers read it.
resource "aws_ssm_parameter" "ray_token" {
  name        = var.ray_token_parameter_name
  description = "Ray auth token of the Sluice cluster ${var.name}; written by the head at boot"
  type        = "SecureString"
  key_id      = var.kms_key_arn
  value       = "unset"

  lifecycle {
    ignore_changes = [value]
  }

  tags = var.tags
}

# --- the head -------------------------------------------------------------------------------

# The MLflow and Prefect databases and the Ray token outlive the head instance on this volume.
resource "aws_ebs_volume" "head_state" {
  availability_zone = data.aws_subnet.head.availability_zone
  size              = var.head_state_volume_gb
  type              = "gp3"
  encrypted         = true
  kms_key_id        = local.ebs_kms_key

  tags = merge(var.tags, { Name = "${var.name}-ray-head-state" })
}

data "aws_subnet" "head" {
  id = var.private_subnet_ids[0]
}

resource "aws_instance" "head" {
  ami                    = var.head_ami_id
  instance_type          = var.head_instance_type
  subnet_id              = var.private_subnet_ids[0]
  vpc_security_group_ids = [aws_security_group.head.id]
  iam_instance_profile   = var.head_instance_profile_name
  ebs_optimized          = true
  monitoring             = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  root_block_device {
    volume_type           = "gp3"
    volume_size           = var.head_root_volume_gb
    encrypted             = true
    kms_key_id            = local.ebs_kms_key
    delete_on_termination = true
  }

  user_data = templatefile("${path.module}/templates/head_user_data.sh.tftpl", {
    region            = data.aws_region.current.name
    pip_packages      = var.head_pip_packages
    state_volume_id   = replace(aws_ebs_volume.head_state.id, "-", "")
    token_parameter   = aws_ssm_parameter.ray_token.name
    kms_key_arn       = var.kms_key_arn
    storage_url       = var.storage_url
    ray_resources     = jsonencode(var.head_ray_resources)
    ports             = local.ports
    run_mlflow        = local.run_mlflow
    run_prefect       = local.run_prefect
    mlflow_uri        = var.mlflow_tracking_uri
    prefect_api_url   = var.prefect_api_url
    prefect_work_pool = var.prefect_work_pool
    file_system_id    = var.shared_file_system_id
    access_point_id   = var.shared_access_point_id
    shared_mount_path = var.shared_mount_path
    sluice_uid        = var.sluice_uid
  })
  user_data_replace_on_change = true

  tags = merge(var.tags, { Name = "${var.name}-ray-head", "sluice:role" = "head" })
}

resource "aws_volume_attachment" "head_state" {
  device_name = "/dev/sdf"
  volume_id   = aws_ebs_volume.head_state.id
  instance_id = aws_instance.head.id
}

# --- spot GPU workers -----------------------------------------------------------------------

resource "aws_launch_template" "worker" {
  for_each = var.worker_groups

  name_prefix            = "${var.name}-${each.key}-"
  description            = "Sluice spot Ray worker group ${each.key}"
  image_id               = var.worker_ami_id
  vpc_security_group_ids = [aws_security_group.worker.id]
  update_default_version = true

  iam_instance_profile {
    name = var.worker_instance_profile_name
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  block_device_mappings {
    device_name = var.worker_root_device_name

    ebs {
      volume_type           = "gp3"
      volume_size           = each.value.root_volume_gb
      encrypted             = true
      kms_key_id            = local.ebs_kms_key
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  user_data = base64encode(templatefile("${path.module}/templates/worker_user_data.sh.tftpl", {
    region            = data.aws_region.current.name
    group             = each.key
    pip_packages      = var.worker_pip_packages
    head_ip           = local.head_ip
    token_parameter   = aws_ssm_parameter.ray_token.name
    storage_url       = var.storage_url
    ray_resources     = jsonencode(each.value.ray_resources)
    ports             = local.ports
    mlflow_uri        = local.mlflow_uri
    prefect_api_url   = local.prefect_api
    file_system_id    = var.shared_file_system_id
    access_point_id   = var.shared_access_point_id
    shared_mount_path = var.shared_mount_path
    sluice_uid        = var.sluice_uid
  }))

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "${var.name}-${each.key}", "sluice:role" = "worker", "sluice:group" = each.key })
  }

  tag_specifications {
    resource_type = "volume"
    tags          = merge(var.tags, { Name = "${var.name}-${each.key}" })
  }

  tags = var.tags
}

resource "aws_autoscaling_group" "worker" {
  for_each = var.worker_groups

  name                = "${var.name}-${each.key}"
  min_size            = each.value.min_size
  max_size            = each.value.max_size
  desired_capacity    = each.value.desired_capacity
  vpc_zone_identifier = var.private_subnet_ids
  health_check_type   = "EC2"
  # Launch a replacement when EC2 signals a raised interruption risk, before the notice.
  capacity_rebalance = true

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = 0
      on_demand_percentage_above_base_capacity = 0
      spot_allocation_strategy                 = var.spot_allocation_strategy
    }

    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.worker[each.key].id
        version            = aws_launch_template.worker[each.key].latest_version
      }

      dynamic "override" {
        for_each = each.value.instance_types

        content {
          instance_type = override.value
        }
      }
    }
  }

  dynamic "tag" {
    for_each = merge(var.tags, { Name = "${var.name}-${each.key}", "sluice:group" = each.key })

    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }

  # Workers need the head's address and token before they can join.
  depends_on = [aws_instance.head]
}
