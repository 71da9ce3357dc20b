# Bake atedevd into a Kubernetes node image.
#
#   make deb            # or: make rpm, for a Fedora/EL-based image
#   packer init packaging/packer
#   packer build -var atedevd_package=dist/atedevd_0.1.0-1_all.deb \
#                -var source_ami=ami-0123456789abcdef0 packaging/packer
#
# The example builds an AWS AMI. For another cloud or a local qemu image, replace
# the source block; the two provisioners stay the same.

packer {
  required_plugins {
    amazon = {
      version = ">= 1.2.0"
      source  = "github.com/hashicorp/amazon"
    }
  }
}

variable "atedevd_package" {
  type        = string
  description = "Path of the atedevd .deb (Debian/Ubuntu images) or .rpm (Fedora/EL images) to install, as built by make deb / make rpm."
}

variable "source_ami" {
  type        = string
  description = "The node image to start from (a Kubernetes node AMI with systemd, e.g. an EKS-optimized or your own base image)."
}

variable "region" {
  type        = string
  default     = "eu-west-1"
  description = "AWS region to build in."
}

variable "instance_type" {
  type        = string
  default     = "t3.small"
  description = "Instance type of the temporary build instance."
}

variable "ssh_username" {
  type        = string
  default     = "admin"
  description = "Login user of the source image (admin on Debian, ubuntu on Ubuntu, ec2-user on Amazon Linux/Fedora/EL)."
}

variable "image_name" {
  type        = string
  default     = "k8s-node-atedevd"
  description = "Name prefix of the resulting image; a timestamp is appended."
}

locals {
  package_file = basename(var.atedevd_package)
  timestamp    = formatdate("YYYYMMDDhhmmss", timestamp())
}

source "amazon-ebs" "node" {
  region        = var.region
  source_ami    = var.source_ami
  instance_type = var.instance_type
  ssh_username  = var.ssh_username
  ami_name      = "${var.image_name}-${local.timestamp}"
}

build {
  sources = ["source.amazon-ebs.node"]

  provisioner "file" {
    source      = var.atedevd_package
    destination = "/tmp/${local.package_file}"
  }

  # Installs the package with apt or dnf, enables atedevd.service, validates the config.
  provisioner "shell" {
    script           = "${path.root}/install-atedevd.sh"
    environment_vars = ["ATEDEVD_PACKAGE=/tmp/${local.package_file}"]
    execute_command  = "chmod +x {{ .Path }}; sudo env {{ .Vars }} {{ .Path }}"
  }
}
