terraform {
  required_version = ">= 1.5.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 6.0"
    }
  }

  # Keep state in an encrypted, versioned bucket of your own, e.g.:
  # backend "s3" {
  #   bucket       = "my-terraform-state"
  #   key          = "sluice/aws-example.tfstate"
  #   region       = "us-east-1"
  #   encrypt      = true
  #   use_lockfile = true
  # }
}

provider "aws" {
  region = var.region

  default_tags {
    tags = {
      Project   = "sluice"
      Cluster   = var.name
      ManagedBy = "terraform"
    }
  }
}
