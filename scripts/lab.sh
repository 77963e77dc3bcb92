#!/usr/bin/env bash
# The main job: a 3-node lab (real etcd, one agent per node, VXLAN) and its reachability matrix.
# Re-running replaces the lab. Tear down with: .venv/bin/flannelpy-lab down --name demo
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --lab  # the Debian packages, .venv and CNI executable; no Go
.venv/bin/flannelpy-lab down --name demo >/dev/null 2>&1 || true
.venv/bin/flannelpy-lab up --name demo --nodes "${NODES:-3}" --backend "${BACKEND:-vxlan}"
.venv/bin/flannelpy-lab status --name demo
