#!/usr/bin/env bash
# Install what flannelpy's lab and tests need on a fresh Debian 12 machine (as root).
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(etcd-server etcd-client iproute2 iptables iputils-ping containernetworking-plugins
              procps psmisc python3-venv podman runc busybox-static ethtool
              nftables  # nft: the tuning/portmap chain test reads the nat table with it
              openssl  # the TLS etcd of the tests makes its certificates with it
              git  # the pools upgrade test and bench/compare_commits.sh read old releases
              containerd  # the CRI test drives containerd 1.6's CRI plugin with our conflist
              debootstrap  # the Debian 12 bases of the flannelpy image (scripts/build-images.sh)
              prometheus  # prometheus: promtool validates manifests/prometheusrule.yaml
              wireguard-go wireguard-tools  # the wireguard backend's userspace device, and wg
              tcpdump  # the wireguard test captures the underlay to see it carries no plaintext
              iperf3)  # bench/throughput.py measures pod-to-pod TCP throughput with it
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml lab/pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing flannelpy and its Python dependencies into .venv" >&2
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e '.[test,kube]'
  # The lab is a package of its own (lab/), outside the wheel the DaemonSet image installs.
  .venv/bin/pip install -q --no-deps -e lab
  rm -f .venv/.installed-* && touch "$stamp"
fi
scripts/build-peers.sh >/dev/null  # the real flanneld the mixed-cluster tests run (needs Go)
scripts/build-kube.sh >/dev/null  # the real Kubernetes control plane of Kubernetes mode (needs Go)
scripts/build-images.sh >/dev/null  # the flannelpy image the lab's kubelets run (cached)
