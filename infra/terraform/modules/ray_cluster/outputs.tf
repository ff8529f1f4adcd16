output "head_instance_id" {
  description = "Instance ID of the head (the target of the SSM tunnel commands)."
  value       = aws_instance.head.id
}

output "head_private_ip" {
  description = "Private address of the head."
  value       = aws_instance.head.private_ip
}

output "ray_address" {
  description = "What a node or a driver inside the VPC passes to `ray start --address` / RAY_ADDRESS."
  value       = "${aws_instance.head.private_ip}:${local.ports.ray_gcs}"
}

output "ray_client_address" {
  description = "Ray client address inside the VPC (from a laptop, tunnel port 10001 and use ray://localhost:10001)."
  value       = "ray://${aws_instance.head.private_ip}:${local.ports.ray_client}"
}

output "ray_dashboard_url" {
  description = "Ray dashboard inside the VPC (from a laptop, tunnel port 8265 and open http://localhost:8265)."
  value       = "http://${aws_instance.head.private_ip}:${local.ports.ray_dashboard}"
}

output "mlflow_tracking_uri" {
  description = "MLflow tracking URI the cluster uses."
  value       = local.mlflow_uri
}

output "prefect_api_url" {
  description = "Prefect API URL the cluster uses."
  value       = local.prefect_api
}

output "ray_token_parameter_name" {
  description = "SSM parameter holding the Ray auth token (read it with `aws ssm get-parameter --with-decryption`)."
  value       = aws_ssm_parameter.ray_token.name
}

output "worker_autoscaling_groups" {
  description = "Autoscaling group name of each worker group."
  value       = { for k, g in aws_autoscaling_group.worker : k => g.name }
}

output "head_security_group_id" {
  description = "Security group of the head."
  value       = aws_security_group.head.id
}

output "worker_security_group_id" {
  description = "Security group of the workers."
  value       = aws_security_group.worker.id
}

output "ssm_tunnel_commands" {
  description = "Commands that forward the head's service ports to localhost through SSM Session Manager."
  value = {
    for service in local.operator_ports : service => join(" ", [
      "aws ssm start-session --region ${data.aws_region.current.name}",
      "--target ${aws_instance.head.id}",
      "--document-name AWS-StartPortForwardingSession",
      "--parameters '{\"portNumber\":[\"${local.ports[service]}\"],\"localPortNumber\":[\"${local.ports[service]}\"]}'",
    ])
  }
}
