variable "name" {
  type        = string
  description = "Name prefix for every resource (lowercase letters, digits and dashes)."

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "The name must be 3-32 characters: lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "vpc_cidr" {
  type        = string
  description = "IPv4 range of the VPC, a /16 to /20 block. Public /24s and private /20s are carved from it."
  default     = "10.40.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0)) && can(regex("^[0-9.]+/(1[6-9]|20)$", var.vpc_cidr))
    error_message = "The vpc_cidr must be an IPv4 CIDR block with a prefix length between /16 and /20."
  }
}

variable "availability_zones" {
  type        = list(string)
  description = "Availability zones to spread subnets over (2 to 6): more zones give spot more capacity pools to draw from."

  validation {
    condition     = length(var.availability_zones) >= 2 && length(var.availability_zones) <= 6 && length(distinct(var.availability_zones)) == length(var.availability_zones)
    error_message = "Give between 2 and 6 distinct availability zones."
  }
}

variable "single_nat_gateway" {
  type        = bool
  description = "One NAT gateway for all private subnets (cheaper) instead of one per zone (survives a zone outage)."
  default     = true
}

variable "flow_log_retention_days" {
  type        = number
  description = "Days to keep VPC flow logs in CloudWatch Logs."
  default     = 365

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.flow_log_retention_days)
    error_message = "The flow_log_retention_days must be a retention period CloudWatch Logs accepts (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288 or 3653)."
  }
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key that encrypts the flow-log group (its key policy must let CloudWatch Logs use it; the storage module's key does)."

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/[0-9a-f-]+$", var.kms_key_arn))
    error_message = "The kms_key_arn must be a KMS key ARN (arn:aws:kms:<region>:<account>:key/<id>)."
  }
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}
