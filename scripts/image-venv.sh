#!/usr/bin/env bash
# Trim the flannelpy image's virtualenv (manifests/Dockerfile, the venv stage) to what the
# agent runs, once pip has installed requirements.lock's runtime section and the project:
#
#   scripts/image-venv.sh VENV
#
# - pip and setuptools go: nothing installs into the image.
# - kubernetes.aio goes (64 MB), the Kubernetes client's asyncio twin, and aiohttp with
#   the packages only it needs, which nothing else imports: the agent uses the synchronous
#   client. scripts/image-check.py, run on the image's files, fails the build if anything
#   the agent imports needs them.
# - Native extensions lose their symbol tables.
# - The Kubernetes client is kept compiled only: each module's byte-code where its source
#   was (a sourceless .pyc imports as the source would), without the 33 MB of generated
#   source. A traceback through it names the file and line but shows no source text.
#   Every other module keeps its source beside its byte-code.
set -euo pipefail

venv=$1
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
UNUSED_PACKAGES=(aiohttp aiohttp-retry aiohappyeyeballs aiosignal attrs frozenlist multidict
                 propcache yarl)
UNUSED_PATHS=(kubernetes/aio)
SOURCELESS=(kubernetes)

"$venv/bin/python" -m pip uninstall -q -y "${UNUSED_PACKAGES[@]}" pip setuptools
for path in "${UNUSED_PATHS[@]}"; do
  rm -rf "${site:?}/$path"
done
find "$site" -name '*.so' -exec strip --strip-unneeded {} +
for package in "${SOURCELESS[@]}"; do
  find "$site/$package" -name __pycache__ -prune -exec rm -rf {} +
  "$venv/bin/python" -m compileall -q -b "$site/$package" >/dev/null  # -b: x.pyc beside x.py
  find "$site/$package" -name '*.py' -delete
done
