#!/usr/bin/env bash
# Build a real peer, pinned by its wrapper module in tests/peers/, into a cache outside git.
# The lab runs them beside our agents (mixed clusters, benchmarks, the cluster DNS); the
# product never needs Go. Rebuilds only when the pin, the wrapper or the Go toolchain
# changes (a stamp holds their hash). Prints the binary's path.
#   scripts/build-peers.sh               flanneld (tests/peers/flanneld)
#   scripts/build-peers.sh flannel-cni   Flannel's CNI plugin, plugins/meta/flannel of
#                                        containernetworking/plugins (tests/peers/flannel-cni)
#   scripts/build-peers.sh kube-network-policies
#                                        the NetworkPolicy sidecar of Flannel's chart (netpol:
#                                        nftables + NFQUEUE), the policy benches' reference,
#                                        with patches/ applied (tests/peers/kube-network-policies)
#   scripts/build-peers.sh --coredns     CoreDNS (tests/peers/coredns: its own main with the
#                                        plugins the lab's cluster DNS uses), static
#   FLANNELPY_PEERS_DIR   cache directory (default /var/cache/flannelpy/peers)
set -euo pipefail
self=$(realpath "${BASH_SOURCE[0]}")  # hashed below, after the cd
cd "$(dirname "$0")/.."

peer=${1:-flanneld}
cgo=${CGO_ENABLED:-1}
case "$peer" in
  flanneld)
    module=github.com/flannel-io/flannel
    package=$module
    binary=flanneld
    version_var=$module/pkg/version.Version
    about="about 2-4 minutes"
    ;;
  flannel-cni)
    module=github.com/containernetworking/plugins
    package=$module/plugins/meta/flannel
    binary=flannel  # the conflist's "type"
    version_var=$module/pkg/utils/buildversion.BuildVersion
    about="about half a minute"
    ;;
  kube-network-policies)
    module=sigs.k8s.io/kube-network-policies
    package=$module/cmd
    binary=kube-network-policies
    version_var=""  # it has no version flag: the check below reads the build info instead
    about="about 1-2 minutes"
    ;;
  coredns | --coredns)
    # CoreDNS runs in an image holding nothing but itself: static.
    peer=coredns module=github.com/coredns/coredns package=. binary=coredns version_var=""
    about="about 4 minutes" cgo=0
    ;;
  *) echo "build-peers: unknown peer '$peer': use flanneld, flannel-cni,\
 kube-network-policies or --coredns" >&2; exit 2 ;;
esac
wrapper=tests/peers/$peer

if ! command -v go >/dev/null; then
  PATH=$PATH:/usr/local/go/bin
fi
if ! command -v go >/dev/null; then
  echo "build-peers: go not found: install Go 1.26 (https://go.dev/dl/) and put it on PATH" >&2
  exit 1
fi

pin=$(awk -v m="$module" '$1 == "require" && $2 == m {print $3}' "$wrapper/go.mod")
if [[ -z $pin ]]; then
  echo "build-peers: $wrapper/go.mod has no 'require $module vX' line: restore it" >&2
  exit 1
fi
out_dir=$(realpath -m "${FLANNELPY_PEERS_DIR:-/var/cache/flannelpy/peers}/$peer-$pin")
out=$out_dir/$binary
stamp=$out_dir/.stamp

# Everything the binary depends on: the wrapper's files, this script and the toolchain.
# By content and by path within the checkout, never by where the checkout is: a clone
# elsewhere reuses the same build.
inputs_hash=$( {
  find "$wrapper" -path "$wrapper/patched" -prune -o -type f ! -name README.md -print0 |
    sort -z | xargs -0 sha256sum
  sha256sum <"$self"
  go version
} | sha256sum | cut -c1-16)

if [[ -x $out && -f $stamp && $(cat "$stamp") == "$inputs_hash" ]]; then
  echo "$out"
  exit 0
fi

echo "build-peers: building $peer $pin (the first build downloads its modules: $about)" >&2
# A wrapper with patches/ builds the pinned module's source with them applied: its go.mod
# replaces the module by ./patched, made here afresh from the module cache (not in git).
if [[ -d $wrapper/patches ]]; then
  if ! command -v patch >/dev/null; then
    echo "build-peers: patch not found: apt-get install patch (scripts/bootstrap.sh does)" >&2
    exit 1
  fi
  dir=$(cd / && go mod download -json "$module@$pin" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  if [[ -z $dir || ! -d $dir ]]; then
    echo "build-peers: go mod download $module@$pin failed; see the output above" >&2
    exit 1
  fi
  rm -rf "$wrapper/patched"
  cp -r "$dir" "$wrapper/patched"
  chmod -R u+w "$wrapper/patched"
  for p in "$wrapper"/patches/*.patch; do
    patch --quiet -d "$wrapper/patched" -p1 <"$p"
  done
fi
mkdir -p "$out_dir"
tmp=$(mktemp "$out_dir/.$binary.XXXXXX")
trap 'rm -f "$tmp"' EXIT
# -mod=readonly: a go.sum out of date with go.mod fails loudly instead of rewriting git files.
(cd "$wrapper" && CGO_ENABLED=$cgo go build -mod=readonly -trimpath -buildvcs=false \
  -ldflags "-s -w${version_var:+ -X $version_var=$pin}" -o "$tmp" "$package")
chmod 0755 "$tmp"
# flanneld prints its version; a CNI plugin run without CNI_COMMAND prints its "about" line;
# CoreDNS says CoreDNS-<version> first; kube-network-policies has no version flag, so the
# module version recorded in the binary's build info stands for it.
if [[ $peer == coredns ]]; then
  reported=$("$tmp" -version 2>&1 | sed -n 1p) expected="CoreDNS-${pin#v}"
elif [[ $peer == kube-network-policies ]]; then
  reported=$(go version -m "$tmp" | awk -v m="$module" '($1 == "mod" || $1 == "dep") && $2 == m {print $3}')
  expected=$pin
else
  reported=$("$tmp" --version 2>&1) expected="*$pin"
fi
# shellcheck disable=SC2053  # expected is a pattern for the flannel peers
if [[ $reported != $expected ]]; then
  echo "build-peers: the built $peer reports '$reported', not '$expected'; see the output above" >&2
  exit 1
fi
mv -f "$tmp" "$out"  # atomic: a running lab never sees half a binary
trap - EXIT
echo "$inputs_hash" >"$stamp"
echo "$out"
