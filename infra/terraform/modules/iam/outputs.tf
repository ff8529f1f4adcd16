output "head_instance_profile_name" {
  description = "Instance profile of the Ray head."
  value       = aws_iam_instance_profile.head.name
}

output "worker_instance_profile_name" {
  description = "Instance profile of the spot Ray workers."
  value       = aws_iam_instance_profile.worker.name
}

output "head_role_arn" {
  description = "ARN of the Ray head's role."
  value       = aws_iam_role.head.arn
}

output "worker_role_arn" {
  description = "ARN of the spot workers' role."
  value       = aws_iam_role.worker.arn
}
