#!/usr/bin/env bash
# Smoke test of the pinned control plane: etcd + kube-apiserver (RBAC, ServiceAccount signing
# key) + kube-controller-manager with the node IPAM controller, all on loopback. Registers a
# Node with kubectl and checks the controller gives it a spec.podCIDR inside --cluster-cidr,
# that a watch delivers it, and that RBAC refuses a ServiceAccount token until a binding allows
# it. Prints the timings. Everything it starts is stopped and removed on exit.
#   ETCD          the etcd server to use (default: etcd on PATH)
#   KUBE_BIN_DIR  the binaries (default: what scripts/build-kube.sh built)
set -euo pipefail
cd "$(dirname "$0")/../../.."
etcd_bin=${ETCD:-etcd}
bin_dir=${KUBE_BIN_DIR:-$(scripts/build-kube.sh)}
cluster_cidr=10.244.0.0/16
work=$(mktemp -d /tmp/kube-smoke.XXXXXX)
pids=()

# A child that has exited stays a zombie until waited for, and kill -0 still finds it.
running() { local state; state=$(ps -o stat= -p "$1") && [[ $state != Z* ]]; }
# stop PID: SIGTERM, then SIGKILL if it has not exited within 10 s.
stop() {
  kill "$1" 2>/dev/null || return 0
  local deadline=$((SECONDS + 10))
  while running "$1" && ((SECONDS < deadline)); do sleep 0.1; done
  kill -KILL "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}
cleanup() {
  local status=$?
  local t0
  t0=$(now)
  # Newest first, so each stops while what it talks to still runs.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do stop "${pids[i]}"; done
  echo "smoke: everything stopped in $(elapsed "$t0") s" >&2
  if ((status != 0)); then
    for log in "$work"/*.log; do
      [[ -f $log ]] && { echo "--- tail of $log"; tail -n 20 "$log"; } >&2
    done
  fi
  rm -rf "$work"
}
trap cleanup EXIT

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN {printf "%.1f", b - a}'; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# wait_for SECONDS WHAT COMMAND...: retry COMMAND every 0.2 s until it succeeds.
wait_for() {
  local timeout=$1 deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      echo "smoke: $what did not happen within ${timeout} s" >&2
      return 1
    fi
    sleep 0.2
  done
}

etcd_port=$(free_port)
etcd_peer_port=$(free_port)
api_port=$(free_port)
kcm_port=$(free_port)

# A CA, the API server's serving certificate and the ServiceAccount signing key.
pki=$work/pki
mkdir -p "$pki"
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=smoke-ca \
  -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver \
  -keyout "$pki/apiserver.key" -out "$pki/apiserver.csr" 2>/dev/null
openssl x509 -req -in "$pki/apiserver.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
  -days 1 -extfile <(echo "subjectAltName=IP:127.0.0.1,DNS:localhost") \
  -out "$pki/apiserver.crt" 2>/dev/null
openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
admin_token=$(openssl rand -hex 16)
kcm_token=$(openssl rand -hex 16)
{
  echo "$admin_token,smoke-admin,uid-admin,system:masters"
  echo "$kcm_token,system:kube-controller-manager,uid-kcm"
} >"$pki/tokens.csv"

kubeconfig() {  # kubeconfig TOKEN: a kubeconfig for the API server with that bearer token
  cat <<EOF
apiVersion: v1
kind: Config
clusters: [{name: smoke, cluster: {server: "https://127.0.0.1:$api_port", certificate-authority: "$pki/ca.crt"}}]
users: [{name: smoke, user: {token: "$1"}}]
contexts: [{name: smoke, context: {cluster: smoke, user: smoke}}]
current-context: smoke
EOF
}
kubeconfig "$admin_token" >"$work/admin.kubeconfig"
kubeconfig "$kcm_token" >"$work/kcm.kubeconfig"
kubectl() { "$bin_dir/kubectl" --kubeconfig "$work/admin.kubeconfig" "$@"; }

t0=$(now)
"$etcd_bin" --name smoke --data-dir "$work/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" \
  --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
  --initial-cluster "smoke=http://127.0.0.1:$etcd_peer_port" >"$work/etcd.log" 2>&1 &
pids+=($!)
wait_for 30 "etcd answering" etcdctl --endpoints "http://127.0.0.1:$etcd_port" endpoint health
echo "smoke: $("$etcd_bin" --version | head -1) ready in $(elapsed "$t0") s"

t0=$(now)
# --endpoint-reconciler-type=none: the API server's address is loopback, which the
# "kubernetes" Service's endpoints may not hold.
"$bin_dir/kube-apiserver" --etcd-servers "http://127.0.0.1:$etcd_port" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
  --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
  --client-ca-file "$pki/ca.crt" --token-auth-file "$pki/tokens.csv" \
  --authorization-mode RBAC --endpoint-reconciler-type none \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16 >"$work/kube-apiserver.log" 2>&1 &
pids+=($!)
wait_for 120 "kube-apiserver ready" kubectl get --raw /readyz
api_ready=$(elapsed "$t0")
echo "smoke: kube-apiserver $("$bin_dir/kube-apiserver" --version) ready in $api_ready s"

t0=$(now)
# --use-service-account-credentials: each controller runs as its own ServiceAccount with the
# bootstrap RBAC role for it, as in a kubeadm cluster.
"$bin_dir/kube-controller-manager" --kubeconfig "$work/kcm.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$kcm_port" --leader-elect=false \
  --use-service-account-credentials --service-account-private-key-file "$pki/sa.key" \
  --root-ca-file "$pki/ca.crt" \
  --allocate-node-cidrs --cluster-cidr "$cluster_cidr" --node-cidr-mask-size 24 \
  >"$work/kube-controller-manager.log" 2>&1 &
pids+=($!)

# A watch opened before the Node exists must deliver the controller's update: etcd's watch
# reaches clients through the API server.
# The binary itself, not the kubectl function: killing a backgrounded function kills only the
# subshell that runs it.
"$bin_dir/kubectl" --kubeconfig "$work/admin.kubeconfig" get nodes --watch-only \
  -o jsonpath='{.metadata.name} {.spec.podCIDR}{"\n"}' >"$work/watch.out" 2>"$work/watch.log" &
pids+=($!)
kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata:
  name: smoke-node-1
status:
  addresses: [{type: InternalIP, address: 192.0.2.10}]
EOF
node_has_pod_cidr() { [[ -n $(kubectl get node smoke-node-1 -o jsonpath='{.spec.podCIDR}') ]]; }
wait_for 60 "smoke-node-1 getting a podCIDR" node_has_pod_cidr
pod_cidr=$(kubectl get node smoke-node-1 -o jsonpath='{.spec.podCIDR}')
echo "smoke: kube-controller-manager gave smoke-node-1 podCIDR $pod_cidr $(elapsed "$t0") s after its start"
if [[ $pod_cidr != 10.244.*.0/24 ]]; then
  echo "smoke: podCIDR $pod_cidr is not a /24 of $cluster_cidr" >&2
  exit 1
fi
watch_saw_pod_cidr() { grep -qx "smoke-node-1 $pod_cidr" "$work/watch.out"; }
wait_for 10 "the watch delivering smoke-node-1 with its podCIDR" watch_saw_pod_cidr
echo "smoke: a watch delivered the update"
# A ServiceAccount token signed with the key authenticates, and RBAC (no binding yet) denies.
kubectl create serviceaccount smoke-agent >/dev/null
sa_token=$(kubectl create token smoke-agent)
sa_kubectl() { "$bin_dir/kubectl" --kubeconfig <(kubeconfig "$sa_token") "$@"; }
if sa_kubectl get nodes >/dev/null 2>"$work/denied.err" || ! grep -q Forbidden "$work/denied.err"; then
  echo "smoke: a ServiceAccount without a binding was not refused with Forbidden: $(cat "$work/denied.err")" >&2
  exit 1
fi
kubectl create clusterrole smoke-node-reader --verb get --resource nodes >/dev/null
kubectl create clusterrolebinding smoke-agent --clusterrole smoke-node-reader \
  --serviceaccount default:smoke-agent >/dev/null
sa_can_get_node() { sa_kubectl get nodes smoke-node-1 -o name; }
wait_for 10 "the binding letting the ServiceAccount read smoke-node-1" sa_can_get_node
echo "smoke: RBAC refused the ServiceAccount, then allowed it once bound"
echo "smoke: ok"
