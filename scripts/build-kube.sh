#!/usr/bin/env bash
# Build a real Kubernetes control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kube-proxy, kubectl), pinned by the wrapper module in
# tests/peers/kubernetes, into a cache outside git. The lab runs it in Kubernetes mode; the
# product never needs Go. With --e2e it builds instead the upstream e2e suite's binaries from
# the same pin: e2e.test (the sig-network specs, tests/peers/kubernetes/e2e), the ginkgo
# runner that runs it in parallel, and agnhost, the program of the image its pods run
# (scripts/conformance.sh). Rebuilds only when the pin, the
# wrapper, this script (its list of binaries too) or the Go toolchain changes (a stamp per set
# holds their hash), or a binary is missing. Prints the directory holding the binaries.
#   FLANNELPY_PEERS_DIR   cache directory (default /var/cache/flannelpy/peers)
set -euo pipefail
cd "$(dirname "$0")/.."
wrapper=tests/peers/kubernetes
case "${1:-}" in
  "") binaries=(kube-apiserver kubectl kube-controller-manager kube-scheduler kubelet kube-proxy)
      files=()
      stamp_name=.stamp ;;
  # The porter's TLS certificate goes into the agnhost image beside it (the proxy specs).
  # regression-issue-74839: the server of the Conntrack spec on invalid conntrack state.
  --e2e) binaries=(e2e.test ginkgo agnhost regression-issue-74839)
         files=(localhost.crt localhost.key)
         stamp_name=.stamp-e2e ;;
  *) echo "build-kube: unknown argument '$1': use --e2e or nothing" >&2; exit 2 ;;
esac

if ! command -v go >/dev/null; then
  PATH=$PATH:/usr/local/go/bin
fi
if ! command -v go >/dev/null; then
  echo "build-kube: go not found: install Go 1.26 (https://go.dev/dl/) and put it on PATH" >&2
  exit 1
fi

# The require line, alone or in the block of direct requirements (the suite's ginkgo is one).
pin=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3}
           $1 == "k8s.io/kubernetes" && $2 ~ /^v/ && $3 != "//" {print $2}' "$wrapper/go.mod")
if [[ -z $pin ]]; then
  echo "build-kube: $wrapper/go.mod requires no k8s.io/kubernetes vX: restore the line" >&2
  exit 1
fi
if [[ ! $pin =~ ^v1\.([0-9]+)\.[0-9]+$ ]]; then
  echo "build-kube: $wrapper/go.mod pins k8s.io/kubernetes $pin: pin a release (v1.N.P)" >&2
  exit 1
fi
minor=${BASH_REMATCH[1]}
out_dir=$(realpath -m "${FLANNELPY_PEERS_DIR:-/var/cache/flannelpy/peers}/kubernetes-$pin")
stamp=$out_dir/$stamp_name

# Everything the binaries depend on: the wrapper's files (the control plane's without the e2e
# suite's main), this script and the toolchain.
skip=(! -path "$wrapper/e2e/*")
[[ $stamp_name == .stamp-e2e ]] && skip=()
inputs_hash=$( {
  find "$wrapper" -type f ! -name README.md ! -name '*.sh' "${skip[@]}" -print0 \
    | sort -z | xargs -0 sha256sum
  sha256sum "${BASH_SOURCE[0]}"
  go version
} | sha256sum | cut -c1-16)

up_to_date=true
for bin in "${binaries[@]}"; do
  [[ -x $out_dir/$bin ]] || up_to_date=false
done
for file in "${files[@]}"; do
  [[ -f $out_dir/$file ]] || up_to_date=false
done
if $up_to_date && [[ -f $stamp && $(cat "$stamp") == "$inputs_hash" ]]; then
  echo "$out_dir"
  exit 0
fi

echo "build-kube: building Kubernetes $pin (${binaries[*]}); the first build takes long, see tests/peers/kubernetes/README.md" >&2
mkdir -p "$out_dir"
tmp_dir=$(mktemp -d "$out_dir/.build.XXXXXX")
trap 'rm -rf "$tmp_dir"' EXIT

# The version variables Kubernetes' own release build sets (hack/lib/version.sh); the API
# server derives its emulation version from them. The build flags follow its release build:
# static, no symbols, trimmed paths, and the tags it builds with.
version_ldflags=""
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  version_ldflags+=" -X $pkg.gitVersion=$pin -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  version_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
started=$SECONDS
# The build flags of Kubernetes' release build (hack/lib/golang.sh): static, no symbols,
# trimmed paths, its tags; the packages the sets share compile once in the go cache. nice:
# tests running beside it keep their timing. -mod=readonly: a go.sum out of date with go.mod
# fails loudly instead of rewriting git files.
go_flags=(-mod=readonly -trimpath -buildvcs=false -tags selinux,notest,grpcnotrace)
if [[ $stamp_name == .stamp ]]; then
  # One go build for every binary: the go tool keeps every core busy across all of them.
  packages=()
  for bin in "${binaries[@]}"; do
    packages+=("k8s.io/kubernetes/cmd/$bin")
  done
  (cd "$wrapper" && CGO_ENABLED=0 nice -n 19 go build "${go_flags[@]}" \
    -ldflags "-s -w$version_ldflags" -o "$tmp_dir/" "${packages[@]}")
else
  # agnhost reports the version its image is tagged with upstream (test/images/agnhost/VERSION).
  agnhost_dir=$(cd "$wrapper" && go list -mod=readonly -f '{{.Dir}}' k8s.io/kubernetes/test/images/agnhost)
  (cd "$wrapper" && CGO_ENABLED=0 nice -n 19 go test -c "${go_flags[@]}" \
    -ldflags "-s -w$version_ldflags" -o "$tmp_dir/e2e.test" ./e2e)
  (cd "$wrapper" && CGO_ENABLED=0 nice -n 19 go build "${go_flags[@]}" \
    -ldflags "-s -w -X main.Version=$(cat "$agnhost_dir/VERSION")" -o "$tmp_dir/agnhost" \
    k8s.io/kubernetes/test/images/agnhost)
  (cd "$wrapper" && CGO_ENABLED=0 nice -n 19 go build "${go_flags[@]}" -ldflags "-s -w" \
    -o "$tmp_dir/regression-issue-74839" k8s.io/kubernetes/test/images/regression-issue-74839)
  # The runner must be the version of the library in e2e.test: the module's own.
  (cd "$wrapper" && CGO_ENABLED=0 nice -n 19 go build "${go_flags[@]}" -ldflags "-s -w" \
    -o "$tmp_dir/ginkgo" github.com/onsi/ginkgo/v2/ginkgo)
  ginkgo_version=$(cd "$wrapper" && go list -mod=readonly -m -f '{{.Version}}' github.com/onsi/ginkgo/v2)
  cp "$agnhost_dir/porter/localhost.crt" "$agnhost_dir/porter/localhost.key" "$tmp_dir/"
fi
for bin in "${binaries[@]}"; do
  if [[ $bin == kubectl ]]; then
    # sed, not head: under pipefail, kubectl writing on after head has exited fails the
    # pipeline (SIGPIPE), which ended a build here without a word.
    reported=$("$tmp_dir/$bin" version --client 2>&1 | sed -n 1p)
    expected="Client Version: $pin"
  elif [[ $bin == e2e.test ]]; then
    # The suite has no version flag of its own: it must at least list the agnhost images.
    reported=$("$tmp_dir/$bin" --list-images 2>&1 | grep -c '^registry.k8s.io/e2e-test-images/agnhost:' || true)
    expected=2
  elif [[ $bin == ginkgo ]]; then
    reported=$("$tmp_dir/$bin" version 2>&1)
    expected="Ginkgo Version ${ginkgo_version#v}"
  elif [[ $bin == regression-issue-74839 ]]; then
    # No version flag: it must at least be a static executable of this machine's kind.
    reported=$(od -An -c -N4 "$tmp_dir/$bin" | tr -d ' ')
    expected=177ELF
  elif [[ $bin == agnhost ]]; then
    reported=$("$tmp_dir/$bin" --version 2>&1)
    expected="app version $(cat "$agnhost_dir/VERSION")"
  else
    reported=$("$tmp_dir/$bin" --version 2>&1)
    expected="Kubernetes $pin"
  fi
  if [[ $reported != "$expected" ]]; then
    echo "build-kube: the built $bin reports '$reported', not '$expected'; see the output above" >&2
    exit 1
  fi
done
echo "build-kube: ${binaries[*]} built in $((SECONDS - started)) s" >&2
for bin in "${binaries[@]}"; do
  chmod 0755 "$tmp_dir/$bin"
  mv -f "$tmp_dir/$bin" "$out_dir/$bin"  # atomic: a running lab never sees half a binary
done
for file in "${files[@]}"; do
  mv -f "$tmp_dir/$file" "$out_dir/$file"
done
echo "$inputs_hash" >"$stamp"
echo "$out_dir"
