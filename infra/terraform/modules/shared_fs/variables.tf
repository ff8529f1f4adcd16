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
  description = "VPC of the cluster (the network module's vpc_id)."

  validation {
    condition     = can(regex("^vpc-[0-9a-f]{8,17}$", var.vpc_id))
    error_message = "The vpc_id must look like vpc-0123456789abcdef0."
  }
}

variable "subnet_ids" {
  type        = list(string)
  description = "Private subnets to put mount targets in, one per availability zone (the network module's private_subnet_ids): every zone a node may start in needs one."

  validation {
    condition     = length(var.subnet_ids) >= 1 && length(distinct(var.subnet_ids)) == length(var.subnet_ids) && alltrue([for s in var.subnet_ids : can(regex("^subnet-[0-9a-f]{8,17}$", s))])
    error_message = "Give at least one distinct subnet ID, each like subnet-0123456789abcdef0."
  }
}

variable "client_security_group_ids" {
  type        = map(string)
  description = "Security groups of the nodes that mount the filesystem, by a name used in rule descriptions (e.g. {head = ..., worker = ...}: the ray_cluster module's head_security_group_id and worker_security_group_id). NFS is allowed from these and from nothing else."

  validation {
    condition     = length(var.client_security_group_ids) >= 1 && alltrue([for k, v in var.client_security_group_ids : can(regex("^[a-z][a-z0-9-]{0,30}$", k)) && can(regex("^sg-[0-9a-f]{8,17}$", v))])
    error_message = "Give at least one security group, keyed by a short lowercase name, each ID like sg-0123456789abcdef0."
  }
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key that encrypts the filesystem at rest (the storage module's kms_key_arn)."

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/[0-9a-f-]+$", var.kms_key_arn))
    error_message = "The kms_key_arn must be a KMS key ARN (arn:aws:kms:<region>:<account>:key/<id>)."
  }
}

variable "owner_uid" {
  type        = number
  description = "POSIX user ID every operation through the access point runs as; the nodes create their `sluice` user with this ID (the ray_cluster module's sluice_uid)."
  default     = 20000

  validation {
    condition     = var.owner_uid >= 1000 && var.owner_uid <= 60000 && floor(var.owner_uid) == var.owner_uid
    error_message = "The owner_uid must be a whole number between 1000 and 60000 (not root, not a system account)."
  }
}

variable "owner_gid" {
  type        = number
  description = "POSIX group ID of the access point's user (the nodes' `sluice` group)."
  default     = 20000

  validation {
    condition     = var.owner_gid >= 1000 && var.owner_gid <= 60000 && floor(var.owner_gid) == var.owner_gid
    error_message = "The owner_gid must be a whole number between 1000 and 60000 (not root, not a system group)."
  }
}

variable "root_directory" {
  type        = string
  description = "Directory of the filesystem the access point exposes as the root of every mount (EFS creates it, owned by owner_uid, on first use)."
  default     = "/sluice"

  validation {
    condition     = can(regex("^(/[A-Za-z0-9_-][A-Za-z0-9._-]*)+$", var.root_directory))
    error_message = "The root_directory must be an absolute path below / (letters, digits, '.', '_', '-'; no trailing '/', no '.' or '..' segments)."
  }
}

variable "transition_to_ia" {
  type        = string
  description = "When files not read for a while move to the cheaper Infrequent Access class (they come back on their first read)."
  default     = "AFTER_30_DAYS"

  validation {
    condition     = contains(["AFTER_1_DAY", "AFTER_7_DAYS", "AFTER_14_DAYS", "AFTER_30_DAYS", "AFTER_60_DAYS", "AFTER_90_DAYS", "AFTER_180_DAYS", "AFTER_270_DAYS", "AFTER_365_DAYS"], var.transition_to_ia)
    error_message = "The transition_to_ia must be one of AFTER_1_DAY, AFTER_7_DAYS, AFTER_14_DAYS, AFTER_30_DAYS, AFTER_60_DAYS, AFTER_90_DAYS, AFTER_180_DAYS, AFTER_270_DAYS, AFTER_365_DAYS."
  }
}

variable "enable_backup" {
  type        = bool
  description = "Daily AWS Backup of the filesystem (35-day retention, the default EFS backup plan). Off by default: what it holds is either rebuildable or also written to S3."
  default     = false
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}
