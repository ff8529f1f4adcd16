# The nodes mount as soon as they boot, so the IDs they need are handed out only once every
# mount target exists (Terraform waits for each to be available) and the nodes' NFS rule and
# the TLS-only policy are in place. The mount targets' DNS names can still take a minute or
# two to resolve; the boot scripts retry.

output "file_system_id" {
  description = "ID of the shared filesystem (fs-...), what efs-utils mounts."
  value       = aws_efs_file_system.this.id
  depends_on  = [aws_efs_mount_target.this, aws_vpc_security_group_ingress_rule.nfs, aws_efs_file_system_policy.this]
}

output "file_system_arn" {
  description = "ARN of the shared filesystem (the resource of the nodes' ClientMount and ClientWrite permissions)."
  value       = aws_efs_file_system.this.arn
}

output "dns_name" {
  description = "DNS name of the filesystem (<id>.efs.<region>.amazonaws.com); resolves, inside the VPC, to the mount target in the caller's zone."
  value       = aws_efs_file_system.this.dns_name
  depends_on  = [aws_efs_mount_target.this]
}

output "access_point_id" {
  description = "ID of the access point the nodes mount through (fsap-...)."
  value       = aws_efs_access_point.sluice.id
  depends_on  = [aws_efs_mount_target.this, aws_vpc_security_group_ingress_rule.nfs, aws_efs_file_system_policy.this]
}

output "access_point_arn" {
  description = "ARN of the access point (the nodes' IAM permissions hold only through it)."
  value       = aws_efs_access_point.sluice.arn
}

output "security_group_id" {
  description = "Security group of the mount targets (the nodes' NFS egress rules point at it)."
  value       = aws_security_group.this.id
}
