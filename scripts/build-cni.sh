#!/usr/bin/env bash
# Build the C CNI forwarder (cni_plugin/forwarder.c) into build/flannelpy-cni: a static
# binary for nodes without a Python interpreter. Installs gcc and the static C library
# with apt when they are missing. Idempotent: does nothing while the binary is newer
# than its source and this script. Prints the binary's path.
set -euo pipefail
cd "$(dirname "$0")/.."
src=cni_plugin/forwarder.c
out=build/flannelpy-cni

if [[ -x $out && $out -nt $src && $out -nt ${BASH_SOURCE[0]} ]]; then
  echo "$out"
  exit 0
fi

have_static_libc() {
  command -v gcc >/dev/null && [[ $(gcc -print-file-name=libc.a) == /* ]]
}
if ! have_static_libc; then
  echo "build-cni: installing gcc and libc6-dev" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null
fi

mkdir -p build
tmp=$(mktemp "build/.flannelpy-cni.XXXXXX")
trap 'rm -f "$tmp"' EXIT
gcc -O2 -static -Wall -Wextra -Werror -o "$tmp" "$src"
chmod 0755 "$tmp"
mv -f "$tmp" "$out"  # atomic: a concurrent run or a running test never sees half a binary
trap - EXIT
echo "$out"
