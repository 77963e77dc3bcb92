#!/usr/bin/env bash
# Judge a cluster's network by Kubernetes' own tests: bring up a 3-node kubelet lab
# (flannelpy-lab up --kubelet: real control plane, kubelets, containerd and kube-proxy) and
# run the upstream e2e network specs on it with ginkgo, from the same pin as the cluster
# (e2e.test, ginkgo and agnhost built by scripts/build-kube.sh --e2e, the images by
# scripts/build-images.sh --e2e and imported into every node's containerd).
#
#   scripts/conformance.sh --cni flannelpy [--proxy-mode iptables|nftables] [--focus REGEX]
#                          [--skip REGEX] [--procs N] [--name LAB] [--network CIDR] [--keep]
#                          [--enable-network-policy] [--out DIR]
#
#   --cni         the network under test: flannelpy (the manifests' DaemonSet) or flanneld
#                 (the reference: flanneld --kube-subnet-mgr on every node and Flannel's CNI
#                 plugin, as kube-flannel.yml deploys them; flannelpy-lab up --network-agent)
#   --focus       the specs (default: every [sig-network] [Conformance] spec and the
#                 Networking Granular Checks)
#   --skip        specs left out; tests/conformance/not-here.txt names them with the reason
#                 (default: the ones this machine cannot run, and [Disruptive]/[Flaky])
#   --procs       ginkgo's parallel processes (default 4: the specs mostly wait for pods)
#   --name        the lab's name (default conf); --keep leaves it up afterwards
#   --out         where the results go (default build/conformance/<cni>-<proxy mode>)
#   --network     the pod network (default 10.160.0.0/16): the host routes it to the nodes,
#                 as a control-plane node in the overlay would (kube-apiserver's proxy to
#                 pods), so no other lab on the host may use it
#   --enable-network-policy
#                 the agents enforce NetworkPolicy (the manifests' network-policy
#                 component); with --focus Netpol this runs upstream's NetworkPolicy specs
#
# The cluster is a real one's: CoreDNS as its DNS (--cluster-dns), the "kubernetes"
# Service with the API server's endpoint, the host routing to pods (--host-pod-routes).
#
# Writes to --out (default build/conformance/<cni>-<proxy mode>, -netpol appended with
# NetworkPolicy on): junit_01.xml, e2e.log (ginkgo's output) and summary.txt (one line per
# spec: passed, failed with the first line of the failure, or skipped with the reason),
# which it prints. Exits 1 when a spec failed.
set -euo pipefail
cd "$(dirname "$0")/.."

cni="" proxy_mode=iptables procs=4 name=conf keep=false network=10.160.0.0/16 policy=false out=""
focus='\[sig-network\].*\[Conformance\]|Networking Granular Checks'
skip=""
while (($#)); do
  case $1 in
    --cni) cni=${2:?--cni needs flannelpy or flanneld}; shift 2 ;;
    --proxy-mode) proxy_mode=${2:?--proxy-mode needs iptables or nftables}; shift 2 ;;
    --focus) focus=${2:?--focus needs a regular expression}; shift 2 ;;
    --skip) skip=${2:?--skip needs a regular expression}; shift 2 ;;
    --procs) procs=${2:?--procs needs a number}; shift 2 ;;
    --name) name=${2:?--name needs a lab name}; shift 2 ;;
    --network) network=${2:?--network needs a CIDR}; shift 2 ;;
    --keep) keep=true; shift ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --enable-network-policy) policy=true; shift ;;
    *) echo "conformance: unknown argument '$1'; see the head of $0" >&2; exit 2 ;;
  esac
done
case $cni in
  flannelpy | flanneld) ;;
  *) echo "conformance: --cni ${cni:-(none)}: pick flannelpy or flanneld" >&2; exit 2 ;;
esac
case $proxy_mode in
  iptables | nftables) ;;
  *) echo "conformance: --proxy-mode $proxy_mode: pick iptables or nftables" >&2; exit 2 ;;
esac
lab_args=(--network-agent "$cni")
if $policy; then
  lab_args+=(--enable-network-policy)
fi
not_here=tests/conformance/not-here.txt
if [[ -z $skip ]]; then
  # Every pattern of not-here.txt (the text before " -- " on each line), joined.
  skip=$(sed -n 's/^\([^#].*\) -- .*/\1/p' "$not_here" | paste -sd'|')
fi

bash scripts/bootstrap.sh >&2  # the suite and its images too, built once per pin
e2e_dir=$(bash scripts/build-kube.sh --e2e)
read -r _ e2e_archive < <(bash scripts/build-images.sh --e2e "$e2e_dir")
default_out=build/conformance/$cni-$proxy_mode title="$cni, kube-proxy $proxy_mode mode"
if $policy; then
  default_out+=-netpol title="$cni with NetworkPolicy, kube-proxy $proxy_mode mode"
fi
out=${out:-$default_out}
rm -rf "$out"
mkdir -p "$out"

lab=.venv/bin/flannelpy-lab
if [[ -e /run/flannelpy-lab/$name ]]; then
  echo "conformance: a lab named $name is up; take it down ($lab down --name $name) or" \
    "pick another --name" >&2
  exit 1
fi
started=$SECONDS
take_down() {
  if ! $keep; then
    $lab down --name "$name" >&2 || echo "conformance: $lab down --name $name failed" >&2
  fi
}
trap take_down EXIT
$lab up --name "$name" --nodes 3 --kubelet --proxy-mode "$proxy_mode" --network "$network" \
  --cluster-dns --host-pod-routes --image-archive "$e2e_archive" "${lab_args[@]}" >&2
kubeconfig=$(.venv/bin/python -c '
import sys
from flannelpy_lab import kube
from flannelpy_lab.lab import Lab
print(kube.admin_kubeconfig(Lab.load(sys.argv[1]).state))' "$name")
lab_seconds=$((SECONDS - started))

echo "conformance: running e2e.test on $cni ($proxy_mode), $procs processes; ginkgo's" \
  "output goes to $out/e2e.log" >&2
rc=0
# ginkgo runs e2e.test in the binary's directory: every path it is given is absolute.
# --num-nodes as upstream's hack/ginkgo-e2e.sh passes it: only the first parallel process
# counts the Nodes itself, and the others would skip every spec that needs two.
"$e2e_dir/ginkgo" --procs="$procs" --focus="$focus" --skip="$skip" --no-color --timeout=3h \
  "$e2e_dir/e2e.test" -- --kubeconfig="$kubeconfig" --provider=skeleton --num-nodes=3 \
  --kubectl-path="$e2e_dir/kubectl" --report-dir="$(realpath "$out")" >"$out/e2e.log" 2>&1 \
  || rc=$?
e2e_seconds=$((SECONDS - started - lab_seconds))

.venv/bin/python scripts/conformance_report.py "$out/junit_01.xml" --focus "$focus" \
  --not-here "$not_here" \
  --title "$title: lab up in $lab_seconds s, specs in $e2e_seconds s" \
  >"$out/summary.txt" || rc=$((rc ? rc : 1))
cat "$out/summary.txt"
exit $((rc ? 1 : 0))
