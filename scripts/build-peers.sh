#!/usr/bin/env bash
# Build the real flanneld, pinned by the wrapper module in tests/peers/flanneld, into a
# cache outside git. The lab runs it beside our agents (mixed clusters, benchmarks); the
# product never needs Go. Rebuilds only when the pin, the wrapper or the Go toolchain
# changes (a stamp holds their hash). Prints the binary's path.
#   FLANNELPY_PEERS_DIR   cache directory (default /var/cache/flannelpy/peers)
set -euo pipefail
cd "$(dirname "$0")/.."
wrapper=tests/peers/flanneld

if ! command -v go >/dev/null; then
  PATH=$PATH:/usr/local/go/bin
fi
if ! command -v go >/dev/null; then
  echo "build-peers: go not found: install Go 1.26 (https://go.dev/dl/) and put it on PATH" >&2
  exit 1
fi

pin=$(awk '$1 == "require" && $2 == "github.com/flannel-io/flannel" {print $3}' "$wrapper/go.mod")
if [[ -z $pin ]]; then
  echo "build-peers: $wrapper/go.mod has no 'require github.com/flannel-io/flannel vX' line: restore it" >&2
  exit 1
fi
out_dir=$(realpath -m "${FLANNELPY_PEERS_DIR:-/var/cache/flannelpy/peers}/flanneld-$pin")
out=$out_dir/flanneld
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

echo "build-peers: building flanneld $pin (the first build downloads its modules: about 2-4 minutes)" >&2
mkdir -p "$out_dir"
tmp=$(mktemp "$out_dir/.flanneld.XXXXXX")
trap 'rm -f "$tmp"' EXIT
# -mod=readonly: a go.sum out of date with go.mod fails loudly instead of rewriting git files.
(cd "$wrapper" && go build -mod=readonly -trimpath -buildvcs=false \
  -ldflags "-s -w -X github.com/flannel-io/flannel/pkg/version.Version=$pin" \
  -o "$tmp" github.com/flannel-io/flannel)
chmod 0755 "$tmp"
if [[ $("$tmp" --version 2>&1) != "$pin" ]]; then
  echo "build-peers: the built flanneld does not report version $pin; see the output above" >&2
  exit 1
fi
mv -f "$tmp" "$out"  # atomic: a running lab never sees half a binary
trap - EXIT
echo "$inputs_hash" >"$stamp"
echo "$out"
