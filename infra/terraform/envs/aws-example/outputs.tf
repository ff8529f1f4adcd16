output "head_instance_id" {
  description = "Instance ID of the head: the --target of the SSM commands."
  value       = module.ray_cluster.head_instance_id
}

output "head_private_ip" {
  description = "Private address of the head."
  value       = module.ray_cluster.head_private_ip
}

output "ray_address" {
  description = "RAY_ADDRESS for drivers inside the VPC (host:port of the GCS)."
  value       = module.ray_cluster.ray_address
}

output "ray_client_address" {
  description = "Ray client address inside the VPC; through the tunnel use ray://localhost:10001."
  value       = module.ray_cluster.ray_client_address
}

output "ray_dashboard_url" {
  description = "Ray dashboard inside the VPC; through the tunnel http://localhost:8265."
  value       = module.ray_cluster.ray_dashboard_url
}

output "mlflow_tracking_uri" {
  description = "MLflow tracking URI of the cluster; through the tunnel http://localhost:5000."
  value       = module.ray_cluster.mlflow_tracking_uri
}

output "prefect_api_url" {
  description = "Prefect API URL of the cluster; through the tunnel http://localhost:4200/api."
  value       = module.ray_cluster.prefect_api_url
}

output "bucket_name" {
  description = "Data bucket."
  value       = module.storage.bucket_name
}

output "storage_url" {
  description = "Sluice's storage.url for runs on this cluster."
  value       = module.storage.storage_url
}

output "ray_token_parameter_name" {
  description = "SSM parameter holding the Ray auth token."
  value       = module.ray_cluster.ray_token_parameter_name
}

output "worker_autoscaling_groups" {
  description = "Autoscaling group of each spot worker group."
  value       = module.ray_cluster.worker_autoscaling_groups
}

output "ssm_tunnel_commands" {
  description = "Port-forwarding commands for the Ray client, the dashboard, MLflow and Prefect."
  value       = module.ray_cluster.ssm_tunnel_commands
}

output "shared_path" {
  description = "Where every node mounts the shared filesystem: clone Sluice under it (e.g. <shared_path>/sluice) and run there."
  value       = var.shared_mount_path
}

output "shared_file_system_id" {
  description = "ID of the shared EFS filesystem."
  value       = module.shared_fs.file_system_id
}

output "shared_fs_dns_name" {
  description = "DNS name of the shared filesystem inside the VPC."
  value       = module.shared_fs.dns_name
}
