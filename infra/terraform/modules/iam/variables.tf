variable "name" {
  type        = string
  description = "Name prefix for the roles and instance profiles (lowercase letters, digits and dashes)."

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "The name must be 3-32 characters: lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "bucket_arn" {
  type        = string
  description = "ARN of the data bucket (the storage module's bucket_arn)."

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:s3:::[a-z0-9][a-z0-9.-]+$", var.bucket_arn))
    error_message = "The bucket_arn must be an S3 bucket ARN (arn:aws:s3:::<bucket>)."
  }
}

variable "prefix" {
  type        = string
  description = "Key prefix the instances may read and write; nothing else in the bucket."

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$", var.prefix))
    error_message = "The prefix must be one or more path segments of letters, digits, '.', '_' and '-', without a leading or trailing '/'."
  }
}

variable "kms_key_arn" {
  type        = string
  description = "ARN of the KMS key that encrypts the bucket and the Ray token parameter."

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/[0-9a-f-]+$", var.kms_key_arn))
    error_message = "The kms_key_arn must be a KMS key ARN (arn:aws:kms:<region>:<account>:key/<id>)."
  }
}

variable "ray_token_parameter_name" {
  type        = string
  description = "SSM parameter holding the Ray cluster's auth token: the head writes it, workers read it."

  validation {
    condition     = can(regex("^/[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$", var.ray_token_parameter_name))
    error_message = "The ray_token_parameter_name must be an SSM parameter path such as /sluice/<name>/ray-auth-token."
  }
}

variable "shared_file_system_arn" {
  type        = string
  description = "ARN of the shared EFS filesystem the nodes mount (the shared_fs module's file_system_arn)."

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:elasticfilesystem:[a-z0-9-]+:[0-9]{12}:file-system/fs-[0-9a-f]+$", var.shared_file_system_arn))
    error_message = "The shared_file_system_arn must be an EFS file system ARN (arn:aws:elasticfilesystem:<region>:<account>:file-system/fs-<id>)."
  }
}

variable "shared_access_point_arn" {
  type        = string
  description = "ARN of the access point the nodes mount through (the shared_fs module's access_point_arn); mounts any other way are not granted."

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:elasticfilesystem:[a-z0-9-]+:[0-9]{12}:access-point/fsap-[0-9a-f]+$", var.shared_access_point_arn))
    error_message = "The shared_access_point_arn must be an EFS access point ARN (arn:aws:elasticfilesystem:<region>:<account>:access-point/fsap-<id>)."
  }
}

variable "enable_ssm_session_manager" {
  type        = bool
  description = "Attach AmazonSSMManagedInstanceCore so operators reach the nodes (and tunnel to the head's services) through SSM Session Manager, with no inbound port."
  default     = true
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}
