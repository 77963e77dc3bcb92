"""The end-to-end tier: lab modules run side by side (scripts/test.sh hands each pytest-xdist
worker whole modules, in collection order), so the longest start first and the workers
finish together instead of one long module starting last."""

from __future__ import annotations

import pytest

# The longest modules, longest first, as the end of a run of scripts/test.sh lists them
# (seconds of tests with 3 workers, 2026-12-06). The others follow in file order.
LONGEST_FIRST = (
    "test_kubelet_cluster.py",  # 314 s
    "test_kube_services.py",  # 245-261 s (with the rollout under Service traffic)
    "test_upstream_subset.py",  # 207-217 s
    "test_kube_services_nftables.py",  # 171 s
    "test_prometheus_alerts.py",  # 170 s
    "test_etcd_cluster.py",  # 144 s
    "test_pools_lab.py",  # 126 s
    "test_warm_capacity.py",  # 112 s
    "test_rollout_lab.py",  # 106 s
    "test_observability.py",  # 100 s
    "test_pods.py",  # 99 s
    "test_kube_rollout.py",  # 72 s
    "test_migration.py",  # 63 s
    "test_agent_dataplane.py",  # 62 s
    "test_kube_netpol.py",  # 60 s
    "test_kube_live_config.py",  # 53 s
    "test_kube_real.py",  # 51 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Reorder this tier's modules, longest first; tests keep their order in a module."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    slots = [i for i, item in enumerate(items) if item.path.parent.name == "e2e"]
    ordered = sorted((items[i] for i in slots), key=lambda it: rank.get(it.path.name, len(rank)))
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item
