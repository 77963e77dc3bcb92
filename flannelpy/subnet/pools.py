"""Which address pools a node may use: field-notes §3's tag semantics as one pure function.

A pool is a CIDR in the store with tags. ``flannelpy.io/role`` says what may
happen there:

- ``1``: opt-in. New leases may be created in the pool; existing ones serve.
- ``0``: excluded (drain). No new leases, **and** existing leases stop receiving new
  pod addresses; running pods keep theirs until they end.
- no role tag: creation fails closed (no new leases), reconciliation fails open
  (existing leases keep serving untouched). The primary pool (the config's
  ``Network``) is the exception: it is eligible without a tag, unless tagged ``0``.

``flannelpy.io/cluster/<name>`` restricts a pool to the named cluster(s); a pool
without one is shared by every cluster using the store. A lease with assigned
pod addresses is never released, whatever the tags say.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Network

ROLE_KEY = "flannelpy.io/role"
CLUSTER_KEY_PREFIX = "flannelpy.io/cluster/"
ROLE_OPT_IN = "1"
ROLE_EXCLUDED = "0"


@dataclass(frozen=True)
class Pool:
    network: IPv4Network
    tags: Mapping[str, str] = field(default_factory=dict)
    primary: bool = False  # the network config's Network

    @property
    def role(self) -> str | None:
        return self.tags.get(ROLE_KEY)

    @property
    def clusters(self) -> frozenset[str]:
        return frozenset(
            key[len(CLUSTER_KEY_PREFIX):] for key in self.tags if key.startswith(CLUSTER_KEY_PREFIX)
        )


@dataclass(frozen=True)
class Eligibility:
    create_leases: bool  # may a node acquire a new lease in this pool?
    allocate_addresses: bool  # may existing leases here hand out new pod addresses?
    reason: str  # one sentence, for logs, `pools list` and errors


def eligibility(pool: Pool, cluster: str | None) -> Eligibility:
    """What ``cluster`` (None: an agent without --cluster-name) may do with ``pool``."""
    if pool.clusters and (cluster is None or cluster not in pool.clusters):
        # Another cluster's pool: nothing new, but never break what runs (fail open).
        scope = ", ".join(sorted(pool.clusters))
        return Eligibility(False, True, f"{pool.network} belongs to cluster(s) {scope}")
    if pool.role == ROLE_EXCLUDED:
        return Eligibility(
            False, False, f"{pool.network} is tagged {ROLE_KEY}=0: draining, nothing new lands"
        )
    if pool.role == ROLE_OPT_IN:
        return Eligibility(True, True, f"{pool.network} is opted in ({ROLE_KEY}=1)")
    if pool.primary:
        return Eligibility(True, True, f"{pool.network} is the primary pool")
    if pool.role is None:
        return Eligibility(
            False, True, f"{pool.network} has no {ROLE_KEY} tag: no new leases, existing ones serve"
        )
    # An unknown role value is treated as no tag: fail closed for creation, open for the rest.
    return Eligibility(
        False, True,
        f"{pool.network} has {ROLE_KEY}={pool.role!r}, which is neither 1 nor 0: no new leases",
    )


def may_release_lease(pool: Pool, cluster: str | None, assigned: int, cooling: int) -> bool:
    """A lease is released only when it may not serve new pods and holds no pod address.

    Cooling addresses count too: releasing them would let another node take the
    subnet and hand an address out again before proxies and peers forgot it.
    """
    if assigned or cooling:
        return False
    return not eligibility(pool, cluster).allocate_addresses
