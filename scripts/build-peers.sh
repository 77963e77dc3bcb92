#!/usr/bin/env bash
# Build the real flanneld, pinned by the wrapper module in tests/peers/flanneld, into a
# cache outside git. The lab runs it beside our agents (mixed clusters, benchmarks); the
# product never needs Go. With --coredns it builds CoreDNS instead, pinned by
# tests/peers/coredns (its own main with the plugins the lab's cluster DNS uses). Rebuilds
# only when the pin, the wrapper or the Go toolchain changes (a stamp holds their hash).
# Prints the binary's path.
#   FLANNELPY_PEERS_DIR   cache directory (default /var/cache/flannelpy/peers)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") name=flanneld wrapper=tests/peers/flanneld module=github.com/flannel-io/flannel
      package=$module version_var=$module/pkg/version.Version cgo=1 ;;
  # CoreDNS runs in an image holding nothing but itself: static.
  --coredns) name=coredns wrapper=tests/peers/coredns module=github.com/coredns/coredns
             package=. version_var="" cgo=0 ;;
  *) echo "build-peers: unknown argument '$1': use --coredns or nothing" >&2; exit 2 ;;
esac

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
out_dir=$(realpath -m "${FLANNELPY_PEERS_DIR:-/var/cache/flannelpy/peers}/$name-$pin")
out=$out_dir/$name
stamp=$out_dir/.stamp

# Everything the binary depends on: the wrapper's files, this script and the toolchain.
inputs_hash=$( {
  find "$wrapper" -type f ! -name README.md -print0 | sort -z | xargs -0 sha256sum
  sha256sum "${BASH_SOURCE[0]}"
  go version
} | sha256sum | cut -c1-16)

if [[ -x $out && -f $stamp && $(cat "$stamp") == "$inputs_hash" ]]; then
  echo "$out"
  exit 0
fi

echo "build-peers: building $name $pin (the first build downloads its modules: about 2-4 minutes)" >&2
mkdir -p "$out_dir"
tmp=$(mktemp "$out_dir/.$name.XXXXXX")
trap 'rm -f "$tmp"' EXIT
# -mod=readonly: a go.sum out of date with go.mod fails loudly instead of rewriting git files.
(cd "$wrapper" && CGO_ENABLED=$cgo go build -mod=readonly -trimpath -buildvcs=false \
  -ldflags "-s -w${version_var:+ -X $version_var=$pin}" -o "$tmp" "$package")
chmod 0755 "$tmp"
if [[ $name == coredns ]]; then
  reported=$("$tmp" -version 2>&1 | sed -n 1p) expected="CoreDNS-${pin#v}"
else
  reported=$("$tmp" --version 2>&1) expected=$pin
fi
if [[ $reported != "$expected" ]]; then
  echo "build-peers: the built $name reports '$reported', not '$expected'; see the output above" >&2
  exit 1
fi
mv -f "$tmp" "$out"  # atomic: a running lab never sees half a binary
trap - EXIT
echo "$inputs_hash" >"$stamp"
echo "$out"
