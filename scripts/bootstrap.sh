#!/usr/bin/env bash
# Install what flannelpy needs on a fresh Debian 12 machine (as root). Idempotent: a second
# run installs nothing new and takes about a second.
#
#   scripts/bootstrap.sh --lab   what the etcd lab needs (scripts/lab.sh): its Debian packages,
#                                the .venv and the static CNI executable; nothing built with Go
#   scripts/bootstrap.sh --dev   the same with the test tools in .venv (scripts/test.sh --fast)
#   scripts/bootstrap.sh         everything the tests need: also the test tools, the Go-built
#                                peers (flanneld, kube-network-policies, Kubernetes), the
#                                flannelpy image and the upstream e2e suite (e2e.test, ginkgo,
#                                agnhost and its images, CoreDNS) that scripts/conformance.sh
#                                and the suite's subset run
#   scripts/bootstrap.sh --conformance   the same (the name older instructions use)
#
# Independent steps run at once: the Go builds need only Go and the module proxy, so they
# start first and overlap the Debian packages, the venv and the image. Each step prints one
# line with its time; its output goes to build/bootstrap/STEP.log, shown when it fails.
set -euo pipefail
cd "$(dirname "$0")/.."

scope=all
case "${1:-}" in
  --lab) scope=lab ;;
  --dev) scope=dev ;;
  --conformance) scope=conformance ;;
  "") ;;
  *) echo "bootstrap: unknown argument '$1': use --lab, --dev, --conformance or nothing" >&2; exit 2 ;;
esac

# What the etcd lab runs: etcd, ip, iptables (masquerade), ping (the matrices), the
# reference portmap plugin its conflist chains, ps/killall, the venv, gcc for the CNI
# executable.
LAB_PACKAGES=(etcd-server etcd-client iproute2 iptables iputils-ping containernetworking-plugins
              procps psmisc python3-venv gcc libc6-dev)
# What the tests add.
TEST_PACKAGES=(podman runc busybox-static ethtool
               nftables  # nft: the tuning/portmap chain test reads the nat table with it
               openssl  # the TLS etcd of the tests makes its certificates with it
               git  # the pools upgrade test and bench/compare_commits.sh read old releases
               containerd  # the CRI test drives containerd 1.6's CRI plugin with our conflist
               debootstrap  # the Debian 12 bases of the flannelpy image (scripts/build-images.sh)
               prometheus  # prometheus: promtool validates manifests/prometheusrule.yaml
               wireguard-go wireguard-tools  # the wireguard backend's userspace device, and wg
               tcpdump  # the wireguard test captures the underlay to see it carries no plaintext
               iperf3  # bench/throughput.py measures pod-to-pod TCP throughput with it
               patch)  # scripts/build-peers.sh patches kube-network-policies before building it

LOG_DIR=build/bootstrap
mkdir -p "$LOG_DIR"
started=$SECONDS

# step NAME COMMAND...: runs COMMAND with its output in $LOG_DIR/NAME.log and prints one line
# with its time, or the log's tail when it fails.
step() {
  local name=$1 t0=$SECONDS
  shift
  # A child shell of its own: errexit is off in a caller's `if`, and must hold in the step.
  if bash -euo pipefail -c '"$@"' "$name" "$@" >"$LOG_DIR/$name.log" 2>&1; then
    echo "bootstrap: $name done in $((SECONDS - t0)) s" >&2
  else
    local rc=$?
    echo "bootstrap: $name failed (exit $rc) after $((SECONDS - t0)) s; the end of $LOG_DIR/$name.log:" >&2
    tail -n 25 "$LOG_DIR/$name.log" | sed 's/^/  | /' >&2
    return "$rc"
  fi
}

apt_packages() {
  local missing=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  ((${#missing[@]})) || return 0
  echo "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# venv SCOPE: the product and the lab in .venv, their dependencies from requirements.lock
# (pinned with hashes, as the image installs them); with "dev" or "all" also the lock's dev
# section, the test tools. uv installs them: the same files and hashes as pip, in about 5 s
# instead of 70. uv itself, pinned in requirements-installer.lock, is kept outside the clone
# by that pin (once per machine: about 15 s). A stamp per extent ("full" serves every scope)
# skips it next time.
venv() {
  local python=${PYTHON:-python3} key uv_home uv
  uv_home=/var/cache/flannelpy/uv-$(sha1sum <requirements-installer.lock | cut -c1-12)
  uv=$uv_home/bin/uv
  if [ ! -x "$uv" ]; then
    rm -rf "$uv_home"
    "$python" -m venv "$uv_home"
    "$uv_home"/bin/pip install -q --require-hashes -r requirements-installer.lock
  fi
  # uv's cache beside the Go peers'; the system's CA store, as pip uses it.
  export UV_CACHE_DIR=${UV_CACHE_DIR:-/var/cache/flannelpy/uv-cache} UV_NATIVE_TLS=1
  [ -x .venv/bin/python ] || "$uv" venv -q --python "$python" .venv
  key=.venv/.installed-$(cat pyproject.toml lab/pyproject.toml requirements.lock | sha1sum | cut -c1-12)
  [ -f "$key-full" ] && return 0
  [[ $1 == lab && -f "$key-lab" ]] && return 0
  extent=full
  if [[ $1 == lab ]]; then
    extent=lab
    "$uv" pip install -q --python .venv/bin/python --require-hashes \
      -r <(sed '/^# --- dev:/,$d' requirements.lock)
  else
    "$uv" pip install -q --python .venv/bin/python --require-hashes -r requirements.lock
  fi
  # The lock's build section holds the build backend: nothing is fetched unpinned.
  "$uv" pip install -q --python .venv/bin/python --no-deps --no-build-isolation -e .
  # The lab is a package of its own (lab/), outside the wheel the DaemonSet image installs.
  "$uv" pip install -q --python .venv/bin/python --no-deps --no-build-isolation -e lab
  rm -f .venv/.installed-*
  touch "$key-$extent"
}

# go_peers: the real flanneld and Flannel's CNI plugin, then the real Kubernetes (the first build
# of all takes about 12 minutes of two cores; each is cached by its pin and takes 0.1 s after
# that).
go_peers() {
  scripts/build-peers.sh && scripts/build-peers.sh flannel-cni && scripts/build-kube.sh
}

# e2e_suite: the upstream e2e suite from the Kubernetes pin, then its images, and CoreDNS,
# the cluster DNS of its lab (the first build takes 7-8 minutes once the control plane's
# build cache is warm, 2 for the images, 4 for CoreDNS; cached by the pins like the peers).
e2e_suite() {
  local dir
  dir=$(scripts/build-kube.sh --e2e)
  scripts/build-peers.sh --coredns  # before the images: agnhost's carries it
  scripts/build-images.sh --e2e "$dir"
}

export -f apt_packages venv go_peers e2e_suite

full=false
[[ $scope == all || $scope == conformance ]] && full=true
pids=()
if $full; then
  step go-peers go_peers &
  pids+=($!)
fi
if $full; then
  step apt apt_packages "${LAB_PACKAGES[@]}" "${TEST_PACKAGES[@]}"
else
  step apt apt_packages "${LAB_PACKAGES[@]}"
fi
step venv venv "$scope" &
pids+=($!)
# kube-network-policies, Flannel's NetworkPolicy sidecar: the reference of the policy benches
# and its e2e test. After apt (its build applies a patch); its first build takes about 3
# minutes of CPU (9 minutes of wall time here under a load of 13-41 from other work).
if $full; then
  step netpol-peer scripts/build-peers.sh kube-network-policies &
  pids+=($!)
fi
step cni-executable scripts/build-cni.sh
# The flannelpy image the lab's kubelets run, unless they are given one of one's own.
if $full && [[ -z ${FLANNELPY_IMAGE_ARCHIVE:-} ]]; then
  step image scripts/build-images.sh &
  pids+=($!)
fi
if $full; then
  step e2e-suite e2e_suite &  # after apt: its images need podman and debootstrap
  pids+=($!)
fi
failed=0
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
if ((failed)); then
  echo "bootstrap: a step failed (above); fix it and run scripts/bootstrap.sh again" >&2
  exit 1
fi
echo "bootstrap: ready in $((SECONDS - started)) s" >&2
