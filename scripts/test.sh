#!/usr/bin/env bash
# The whole test suite: lint, types, unit, integration (network namespaces) and the
# end-to-end netns lab with real etcd and agents. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check flannelpy cni_plugin lab tests bench
.venv/bin/mypy flannelpy cni_plugin lab/flannelpy_lab
.venv/bin/lint-imports  # the layer contracts in pyproject.toml
.venv/bin/python -m pytest tests "$@"
