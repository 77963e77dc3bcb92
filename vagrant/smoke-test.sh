#!/usr/bin/env bash
# Smoke test of pod networking: one busybox pod on every node (control plane included),
# then every pod pings every other pod. Exits non-zero on the first failure and deletes
# what it created either way. Uses the current kubectl context (KUBECONFIG).
set -euo pipefail

NS=flannelpy-smoke
POD_CIDR=${POD_CIDR:-10.244.0.0/16}   # only for the message; the agent's net-conf.json decides

cleanup() { kubectl delete namespace "$NS" --ignore-not-found --wait=false >/dev/null; }
trap cleanup EXIT

kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f - <<EOF
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: pinger
  namespace: $NS
spec:
  selector:
    matchLabels: {app: pinger}
  template:
    metadata:
      labels: {app: pinger}
    spec:
      tolerations:
      - operator: Exists
        effect: NoSchedule
      terminationGracePeriodSeconds: 1
      containers:
      - name: busybox
        image: busybox:1.36
        command: [sleep, "3600"]
EOF

kubectl -n "$NS" rollout status daemonset/pinger --timeout=180s

nodes=$(kubectl get nodes --no-headers | wc -l)
mapfile -t pods < <(kubectl -n "$NS" get pods -l app=pinger \
  -o jsonpath='{range .items[*]}{.metadata.name} {.spec.nodeName} {.status.podIP}{"\n"}{end}')
if ((${#pods[@]} != nodes)); then
  echo "smoke-test: expected one pod on each of $nodes nodes, got ${#pods[@]}" >&2
  exit 1
fi
printf 'pods (expected inside %s):\n' "$POD_CIDR"
printf '  %s\n' "${pods[@]}"

failed=0
for src in "${pods[@]}"; do
  read -r src_pod src_node _ <<<"$src"
  for dst in "${pods[@]}"; do
    read -r _ dst_node dst_ip <<<"$dst"
    [[ $src_node == "$dst_node" ]] && continue
    if kubectl -n "$NS" exec "$src_pod" -- ping -c 2 -W 2 "$dst_ip" >/dev/null; then
      echo "ok    $src_node -> $dst_node ($dst_ip)"
    else
      echo "FAIL  $src_node -> $dst_node ($dst_ip)"
      failed=1
    fi
  done
done

if ((failed)); then
  echo "smoke-test: some pods cannot reach each other" >&2
  exit 1
fi
echo "smoke-test: all pods on $nodes nodes reach each other"
