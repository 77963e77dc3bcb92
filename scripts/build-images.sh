#!/usr/bin/env bash
# Build the flannelpy image from manifests/Dockerfile without a registry, for the lab's
# real kubelets (flannelpy-lab up --kubelet), and save it as an archive `ctr images import`
# reads. Prints "<image reference> <archive path>".
#
# The base of every stage (BASE) is Debian 12 made here by debootstrap and imported into
# podman, with every package a stage would install (gcc for the CNI executable, python3-venv
# and binutils for the virtualenv, the image's own programs), so no stage runs apt. Every
# step is cached outside git, under $FLANNELPY_IMAGES_DIR (default
# /var/cache/flannelpy/images): the base by its package list, the image by a hash of
# everything the Dockerfile copies and of its base.
# The build runs with the host's network (apt and pip inside reach what the host reaches)
# and trusts the host's CA bundle.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGES_DIR=${FLANNELPY_IMAGES_DIR:-/var/cache/flannelpy/images}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_PACKAGES=gcc,libc6-dev,python3-venv,binutils,python3,iproute2,iptables,nftables,wireguard-go,ca-certificates,busybox
mkdir -p "$IMAGES_DIR/podman"
# One build at a time: labs starting side by side would otherwise build the same image
# into the same archive at once (podman refuses to modify an archive another build writes).
# The ones that wait find it cached.
exec 9>"$IMAGES_DIR/.build.lock"
flock 9

# podman of its own: vfs storage (any filesystem), cgroupfs, file locks and events.
cat >"$IMAGES_DIR/podman/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$IMAGES_DIR/podman/events.log"
lock_type = "file"
tmp_dir = "$IMAGES_DIR/podman/tmp"
EOF
cat >"$IMAGES_DIR/podman/storage.conf" <<EOF
[storage]
driver = "vfs"
graphroot = "$IMAGES_DIR/podman/storage"
runroot = "$IMAGES_DIR/podman/run"
EOF
echo 'unqualified-search-registries = []' >"$IMAGES_DIR/podman/registries.conf"
export CONTAINERS_CONF=$IMAGES_DIR/podman/containers.conf
export CONTAINERS_STORAGE_CONF=$IMAGES_DIR/podman/storage.conf
export CONTAINERS_REGISTRIES_CONF=$IMAGES_DIR/podman/registries.conf

# base PACKAGES: prints the reference of a debootstrapped Debian 12 with PACKAGES.
base() {
  local key ref tar root
  key=$(printf '%s\n' "bookworm" "$1" | sha256sum | cut -c1-12)
  ref=localhost/flannelpy-base:$key
  tar=$IMAGES_DIR/base-$key.tar
  if [ ! -f "$tar" ]; then
    echo "build-images: debootstrap of Debian 12 with $1" >&2
    root=$(mktemp -d "$IMAGES_DIR/rootfs.XXXXXX")
    debootstrap --variant=minbase --include="$1" bookworm "$root" "$MIRROR" >&2 \
      || { rm -rf "$root"; return 1; }
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
    tar -C "$root" --numeric-owner -cf "$tar.tmp" . && mv "$tar.tmp" "$tar"
    rm -rf "$root"
  fi
  podman image exists "$ref" || podman import "$tar" "$ref" >/dev/null
  echo "$ref"
}
build_base=$(base "$BASE_PACKAGES")

# Everything the Dockerfile copies, and the base it builds on.
key=$( { echo "$build_base"; cat manifests/Dockerfile pyproject.toml requirements.lock README.md \
           scripts/build-cni.sh scripts/image-venv.sh scripts/image-rootfs.sh scripts/image-check.py;
         find flannelpy cni_plugin -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 \
           | sort -z | xargs -0 cat; } | sha256sum | cut -c1-12)
ref=localhost/flannelpy:$key
archive=$IMAGES_DIR/flannelpy-$key.tar
if [ ! -f "$archive" ]; then
  echo "build-images: podman build of $ref" >&2
  podman build --network=host --pull=never --build-arg "BASE=$build_base" \
    -f manifests/Dockerfile -t "$ref" . >&2
  podman save --format docker-archive -o "$archive.tmp" "$ref" >/dev/null
  mv "$archive.tmp" "$archive"
  # Only the newest image is kept: older archives and images are removed.
  find "$IMAGES_DIR" -maxdepth 1 -name 'flannelpy-*.tar' ! -name "flannelpy-$key.tar" -delete
  podman images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/flannelpy:' \
    | grep -vx "$ref" | xargs -r podman rmi >/dev/null 2>&1 || true
  podman image prune -f >/dev/null 2>&1 || true
fi
echo "$ref $archive"
