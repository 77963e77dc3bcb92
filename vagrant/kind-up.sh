#!/usr/bin/env bash
# Build the flannelpy image, start a 3-node kind cluster without a default CNI, load the
# image into its nodes, deploy manifests/ and run the smoke test.
# Needs docker, kind and kubectl. Untested in flannelpy's own CI (no Docker there).
#   vagrant/kind-up.sh            # create (or reuse) the cluster and test it
#   kind delete cluster --name flannelpy
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-flannelpy}
IMAGE=${IMAGE:-flannelpy:0.1.0}   # the tag manifests/kube-flannelpy.yml uses

for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || { echo "kind-up: $tool is not installed" >&2; exit 1; }
done

docker build -f manifests/Dockerfile -t "$IMAGE" .

if ! kind get clusters | grep -qx "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" --config vagrant/kind-config.yaml
fi
kubectl config use-context "kind-$CLUSTER"
kind load docker-image "$IMAGE" --name "$CLUSTER"

kubectl apply -k manifests
kubectl -n kube-flannelpy rollout status daemonset/kube-flannelpy-ds --timeout=300s
kubectl wait --for=condition=Ready node --all --timeout=300s

bash vagrant/smoke-test.sh
