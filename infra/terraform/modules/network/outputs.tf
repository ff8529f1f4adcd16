output "vpc_id" {
  description = "ID of the VPC."
  value       = aws_vpc.this.id
}

output "vpc_cidr" {
  description = "IPv4 range of the VPC."
  value       = aws_vpc.this.cidr_block
}

output "private_subnet_ids" {
  description = "Private subnets, one per availability zone, in the order of var.availability_zones."
  value       = aws_subnet.private[*].id
}

output "public_subnet_ids" {
  description = "Public subnets (NAT gateways only)."
  value       = aws_subnet.public[*].id
}

output "nat_public_ips" {
  description = "Public addresses the cluster's outbound traffic comes from (for allow-lists elsewhere)."
  value       = aws_eip.nat[*].public_ip
}

output "s3_endpoint_id" {
  description = "ID of the S3 gateway endpoint on the private route tables."
  value       = aws_vpc_endpoint.s3.id
}
