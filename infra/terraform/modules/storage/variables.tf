variable "name" {
  type        = string
  description = "Name prefix for the KMS alias and tags (lowercase letters, digits and dashes)."

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "The name must be 3-32 characters: lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "bucket_name" {
  type        = string
  description = "Globally unique name of the bucket that holds trajectories, the ledger and checkpoints."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,56}[a-z0-9]$", var.bucket_name)) && !can(regex("\\.\\.|^xn--|-s3alias$|^[0-9.]+$", var.bucket_name))
    error_message = "The bucket_name must follow S3 naming rules: 3-58 lowercase letters, digits, dots and dashes (the log bucket adds -logs), not an IP address, no '..'."
  }
}

variable "prefix" {
  type        = string
  description = "Key prefix Sluice writes under (its storage.url is s3://<bucket>/<prefix>); the instance roles may touch nothing else."
  default     = "sluice"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$", var.prefix))
    error_message = "The prefix must be one or more path segments of letters, digits, '.', '_' and '-', without a leading or trailing '/'."
  }
}

variable "force_destroy" {
  type        = bool
  description = "Let `terraform destroy` delete a bucket that still holds objects. Leave false unless the data is disposable."
  default     = false
}

variable "noncurrent_version_expiration_days" {
  type        = number
  description = "Days an overwritten or deleted object version is kept (Sluice prunes old checkpoints; with versioning they stay this long, then go)."
  default     = 30

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1 && var.noncurrent_version_expiration_days <= 3650 && floor(var.noncurrent_version_expiration_days) == var.noncurrent_version_expiration_days
    error_message = "The noncurrent_version_expiration_days must be a whole number of days between 1 and 3650."
  }
}

variable "abort_incomplete_multipart_days" {
  type        = number
  description = "Days after which S3 discards the parts of an upload that never completed (a worker lost mid-checkpoint)."
  default     = 7

  validation {
    condition     = var.abort_incomplete_multipart_days >= 1 && var.abort_incomplete_multipart_days <= 365 && floor(var.abort_incomplete_multipart_days) == var.abort_incomplete_multipart_days
    error_message = "The abort_incomplete_multipart_days must be a whole number of days between 1 and 365."
  }
}

variable "access_log_expiration_days" {
  type        = number
  description = "Days S3 server access logs of the data bucket are kept."
  default     = 365

  validation {
    condition     = var.access_log_expiration_days >= 1 && var.access_log_expiration_days <= 3650 && floor(var.access_log_expiration_days) == var.access_log_expiration_days
    error_message = "The access_log_expiration_days must be a whole number of days between 1 and 3650."
  }
}

variable "kms_deletion_window_days" {
  type        = number
  description = "Days a deleted KMS key can still be recovered (AWS allows 7 to 30)."
  default     = 30

  validation {
    condition     = var.kms_deletion_window_days >= 7 && var.kms_deletion_window_days <= 30 && floor(var.kms_deletion_window_days) == var.kms_deletion_window_days
    error_message = "The kms_deletion_window_days must be a whole number between 7 and 30."
  }
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}
