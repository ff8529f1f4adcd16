output "bucket_name" {
  description = "Name of the data bucket."
  value       = aws_s3_bucket.data.id
}

output "bucket_arn" {
  description = "ARN of the data bucket."
  value       = aws_s3_bucket.data.arn
}

output "prefix" {
  description = "Key prefix Sluice writes under."
  value       = var.prefix
}

output "storage_url" {
  description = "Sluice's storage.url for runs on this cluster: s3://<bucket>/<prefix>."
  value       = "s3://${aws_s3_bucket.data.id}/${var.prefix}"
}

output "kms_key_arn" {
  description = "ARN of the customer-managed KMS key (bucket, Ray token parameter, flow logs, shared filesystem)."
  value       = aws_kms_key.this.arn
}

output "access_log_bucket_name" {
  description = "Bucket that receives the data bucket's S3 server access logs."
  value       = aws_s3_bucket.access_logs.id
}
