#!/usr/bin/env bash
# Build the flannelpy image from manifests/Dockerfile without a registry, for the lab's
# real kubelets (flannelpy-lab up --kubelet), and save it as an archive `ctr images import`
# reads. Prints "<image reference> <archive path>".
#   scripts/build-images.sh --e2e DIR   instead the images of the upstream e2e network specs
#     (tests/conformance/images.Containerfile) around the agnhost in DIR (the directory
#     scripts/build-kube.sh --e2e prints), every one tagged as `e2e.test --list-images` names
#     it, in one archive: prints "<first reference> <archive path>"
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

e2e_dir=""
case "${1:-}" in
  "") ;;
  --e2e) e2e_dir=${2:?build-images: --e2e needs the directory scripts/build-kube.sh --e2e prints} ;;
  *) echo "build-images: unknown argument '$1': use --e2e DIR or nothing" >&2; exit 2 ;;
esac

IMAGES_DIR=${FLANNELPY_IMAGES_DIR:-/var/cache/flannelpy/images}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEEP_IMAGES=4  # flannelpy archives and e2e archives kept, newest first
BASE_PACKAGES=gcc,libc6-dev,python3-venv,binutils,python3,iproute2,iptables,nftables,wireguard-go,ca-certificates,busybox
# What the e2e specs exec in their pods (upstream's agnhost image has the same from Alpine).
E2E_PACKAGES=bash,curl,wget,netcat-openbsd,iproute2,bind9-dnsutils,iputils-ping,procps,ca-certificates
# The e2e images: a Containerfile stage and the references it is tagged with (v1.37.2's
# test/utils/image/manifest.go; scripts/conformance.sh checks them against --list-images).
E2E_IMAGES=(
  "agnhost registry.k8s.io/e2e-test-images/agnhost:2.66.1 registry.k8s.io/e2e-test-images/agnhost:2.55"
  "pause registry.k8s.io/pause:3.10.2"
  "nginx registry.k8s.io/e2e-test-images/nginx:1.27.0-2"
  "shell registry.k8s.io/e2e-test-images/busybox:1.37.0-2 registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1"
  "regression registry.k8s.io/e2e-test-images/regression-issue-74839:1.5"
)
mkdir -p "$IMAGES_DIR/podman"

# base_ref PACKAGES: the reference base() gives a Debian 12 base with PACKAGES.
base_ref() {
  echo "localhost/flannelpy-base:$(printf '%s\n' "bookworm" "$1" | sha256sum | cut -c1-12)"
}

# e2e_key: the e2e images' cache key, from their base, tags, Containerfile and agnhost.
e2e_key() {
  { echo "$(base_ref "$E2E_PACKAGES") ${E2E_IMAGES[*]}"; cat tests/conformance/images.Containerfile
    cat "$e2e_dir/agnhost" "$e2e_dir/regression-issue-74839" "$e2e_dir/localhost.crt" \
      "$e2e_dir/localhost.key" "$coredns"; } \
    | sha256sum | cut -c1-12
}

# agnhost's image carries CoreDNS as /coredns (the DNS specs' test server runs it): ours.
[[ -n $e2e_dir ]] && coredns=$(scripts/build-peers.sh --coredns)
# The e2e archive, when cached, needs no podman: no wait on another build's lock.
if [[ -n $e2e_dir && -f $e2e_dir/agnhost && -f $e2e_dir/regression-issue-74839 &&
      -f $IMAGES_DIR/e2e-$(e2e_key).tar ]]; then
  read -r _ first_ref _ <<<"${E2E_IMAGES[0]}"
  echo "$first_ref $IMAGES_DIR/e2e-$(e2e_key).tar"
  exit 0
fi

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
# e2e_images: prints the reference of the first e2e image and the archive holding them all.
e2e_images() {
  local e2e_base key archive context stage refs tags=() all=() entry ref
  for f in agnhost regression-issue-74839 localhost.crt localhost.key; do
    [ -f "$e2e_dir/$f" ] || { echo "build-images: no $f in $e2e_dir: run scripts/build-kube.sh --e2e" >&2; return 1; }
  done
  e2e_base=$(base "$E2E_PACKAGES")
  key=$(e2e_key)
  archive=$IMAGES_DIR/e2e-$key.tar
  for entry in "${E2E_IMAGES[@]}"; do
    read -r stage refs <<<"$entry"
    all+=($refs)
  done
  if [ ! -f "$archive" ]; then
    context=$(mktemp -d "$IMAGES_DIR/e2e-context.XXXXXX")
    cp "$e2e_dir/agnhost" "$e2e_dir/regression-issue-74839" "$e2e_dir/localhost.crt" \
      "$e2e_dir/localhost.key" "$coredns" "$context/"
    for entry in "${E2E_IMAGES[@]}"; do
      read -r stage refs <<<"$entry"
      tags=()
      for ref in $refs; do tags+=(-t "$ref"); done
      echo "build-images: podman build of $refs" >&2
      podman build --network=host --pull=never --build-arg "BASE=$e2e_base" --target "$stage" \
        -f tests/conformance/images.Containerfile "${tags[@]}" "$context" >&2 \
        || { rm -rf "$context"; return 1; }
    done
    rm -rf "$context"
    podman save -m --format docker-archive -o "$archive.tmp" "${all[@]}" >/dev/null
    mv "$archive.tmp" "$archive"
    ls -t "$IMAGES_DIR"/e2e-*.tar | tail -n +$((KEEP_IMAGES + 1)) | xargs -r rm -f
  fi
  echo "${all[0]} $archive"
}

if [[ -n $e2e_dir ]]; then
  e2e_images
  exit 0
fi

build_base=$(base "$BASE_PACKAGES")

# Everything the Dockerfile copies, and the base it builds on.
key=$( { echo "$build_base"; cat manifests/Dockerfile pyproject.toml requirements.lock \
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
  # The newest KEEP_IMAGES archives are kept (checkouts of other commits on this machine,
  # a bench's before and after, use theirs); older archives and their images are removed.
  mapfile -t old < <(ls -t "$IMAGES_DIR"/flannelpy-*.tar | tail -n +$((KEEP_IMAGES + 1)))
  for tar in "${old[@]}"; do
    rm -f "$tar"
    old_key=${tar##*/flannelpy-}
    podman rmi "localhost/flannelpy:${old_key%.tar}" >/dev/null 2>&1 || true
  done
  podman image prune -f >/dev/null 2>&1 || true
fi
echo "$ref $archive"
