#!/usr/bin/env bash
# Run the agent start-to-ready, CNI latency, propagation and idle-CPU benchmarks for two commits in
# one run, each from its own work tree and virtualenv, alternating before/after for
# ROUNDS rounds (default 3), so both sides see the same load whatever else the machine
# does. Needs root. A benchmark that misses its own goal exits non-zero; that is
# reported and the run goes on.
#   bash bench/compare_commits.sh BEFORE [AFTER]     (AFTER defaults to the work tree itself)
# BENCHES (one benchmark command a line) replaces the default list, e.g. to bisect one figure:
#   BENCHES="bench.cni_latency --pods 100 --repeat 1" bash bench/compare_commits.sh BEFORE
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: bench/compare_commits.sh BEFORE [AFTER]}
after=${2:-}
base=${TMPDIR:-/tmp}/flannelpy-bench

prepare() {  # $1 = commit -> prints the tree's path
  local sha tree
  sha=$(git rev-parse --short "$1")
  tree=$base/$sha
  if [[ ! -d $tree ]]; then
    git worktree add -f --detach "$tree" "$sha" >/dev/null 2>&1
  fi
  if [[ ! -x $tree/.venv/bin/python ]]; then
    python3 -m venv "$tree/.venv"
    "$tree/.venv/bin/pip" install -q -e "$tree[test,kube]" >&2
    if [[ -f $tree/lab/pyproject.toml ]]; then
      "$tree/.venv/bin/pip" install -q --no-deps -e "$tree/lab" >&2
    fi
  fi
  (cd "$tree" && bash scripts/build-cni.sh >/dev/null)
  echo "$tree"
}

trees=("$(prepare "$before")")
labels=("before $(git rev-parse --short "$before")")
if [[ -n $after ]]; then
  trees+=("$(prepare "$after")")
  labels+=("after $(git rev-parse --short "$after")")
else
  bash scripts/build-cni.sh >/dev/null
  trees+=("$PWD")
  labels+=("after (work tree)")
fi

rounds=${ROUNDS:-3}
benches=(
  "bench.agent_start --peers 1000 5000 --repeat 2"
  "bench.cni_latency --pods 100 --repeat 1"
  "bench.propagation --nodes 10 --leases 50"
  # idle CPU over 60 s at 1,000 peers (flanneld beside each side, as a yardstick)
  "bench.versus_flanneld --peers 1000 --repeat 1 --changes 200 --idle-seconds 60 --nodes 0"
)
if [[ -n ${BENCHES:-} ]]; then
  mapfile -t benches <<<"$BENCHES"
fi
for bench in "${benches[@]}"; do
  for ((round = 1; round <= rounds; round++)); do
    for i in "${!trees[@]}"; do
      echo "=== round $round, ${labels[$i]}: $bench"
      # shellcheck disable=SC2086
      (cd "${trees[$i]}" && .venv/bin/python -m $bench 2>/dev/null) || echo "(exit $?)"
    done
  done
done
