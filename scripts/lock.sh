#!/usr/bin/env bash
# Refresh requirements.lock from pyproject.toml: every Python package the image, the
# bootstrap and CI install, pinned with hashes (scripts/lock.py says how). Run it after
# changing a dependency in pyproject.toml, or to take newer releases within its ranges;
# commit the lock with the change, then scripts/bootstrap.sh installs it. About 3 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

PIP_TOOLS=pip-tools==7.6.2
tools=build/lock-venv
if [ ! -x "$tools/bin/pip-compile" ]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q "$PIP_TOOLS"
fi
PATH=$PWD/$tools/bin:$PATH "$tools/bin/python" scripts/lock.py
