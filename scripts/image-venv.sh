#!/usr/bin/env bash
# Trim the flannelpy image's virtualenv (manifests/Dockerfile, the venv stage) to what the
# agent runs, once pip has installed requirements.lock's runtime section and the project:
#
#   scripts/image-venv.sh VENV
#
# - pip and setuptools go: nothing installs into the image.
# - Native extensions lose their symbol tables.
#
# The kubernetes package is not installed at all (the agent speaks to the API server through
# flannelpy/store/kube/client.py), so neither are its asyncio twin, aiohttp, pydantic and
# the rest it pulled in: the runtime section of requirements.lock holds eight packages.
# scripts/image-check.py, run on the image's files, fails the build if the agent imports
# anything the image lacks.
set -euo pipefail

venv=$1
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')

"$venv/bin/python" -m pip uninstall -q -y pip setuptools
find "$site" -name '*.so' -exec strip --strip-unneeded {} +
