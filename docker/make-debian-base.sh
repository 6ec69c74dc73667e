#!/usr/bin/env bash
# Make a Debian base image without any image registry: debootstrap a bookworm root file
# system from Debian's package mirror and import it into podman (or docker).
#
#   sudo bash docker/make-debian-base.sh [IMAGE] [WORKDIR]
#     IMAGE    default localhost/hsx-debian:bookworm
#     WORKDIR  default /var/tmp/hsx-image (the rootfs is made in WORKDIR/rootfs)
#   EXTRA_CA_DIR=/usr/local/share/ca-certificates   CA certificates (*.crt) the image must
#       trust too, e.g. a proxy's that re-signs TLS on the way out; PIP_CERT then points
#       pip at the system bundle, which has them.
#   MIRROR=http://deb.debian.org/debian   ENGINE=podman|docker
#
# Then: podman build --build-arg BASE_IMAGE=localhost/hsx-debian:bookworm -f docker/Dockerfile.cpu ...
set -euo pipefail
IMAGE=${1:-localhost/hsx-debian:bookworm}
WORK=${2:-/var/tmp/hsx-image}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ENGINE=${ENGINE:-podman}
ROOTFS="$WORK/rootfs"

mkdir -p "$WORK"
if [ ! -x "$ROOTFS/usr/bin/apt-get" ]; then
  rm -rf "$ROOTFS"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$ROOTFS" "$MIRROR"
fi
if [ -n "${EXTRA_CA_DIR:-}" ]; then
  cp "$EXTRA_CA_DIR"/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
  chroot "$ROOTFS" update-ca-certificates
fi
# What a slim base image drops: apt's caches and lists, docs.
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/*
tar -C "$ROOTFS" -c . | "$ENGINE" import \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' - "$IMAGE"
echo "base image: $IMAGE"
