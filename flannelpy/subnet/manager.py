"""The subnet manager protocol: the only thing the agent knows of its lease store.

etcd mode (:mod:`flannelpy.store.etcd`) is the reference; Kubernetes mode
implements the same protocol with what the API server gives. Keep it small.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from ipaddress import IPv4Network, IPv6Network
from typing import Protocol

from flannelpy.config.netconf import NetworkConfig
from flannelpy.errors import StoreUnavailable
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.pools import Pool
from flannelpy.subnet.validate import Rejection

# Called with every lease in the store (our own included), keyed by lease key,
# and the store revision that snapshot reflects. Called once after the initial
# list and again after every batch of watch events. The mapping is a snapshot made for
# the call: the watch never changes it afterwards, so the callee keeps it uncopied (a
# copy of thousands of leases touches every one), and must not change it either.
LeasesCallback = Callable[[Mapping[str, Lease], int], None]


class CallbackFailed(Exception):
    """Carries an exception of the agent's callback past a watch loop's own handling
    (the loop retries every error of its own, and only those)."""


def guarded(on_leases: LeasesCallback) -> LeasesCallback:
    """``on_leases``, with its exceptions wrapped in CallbackFailed."""

    def call(leases: Mapping[str, Lease], revision: int) -> None:
        try:
            on_leases(leases, revision)
        except Exception as e:
            raise CallbackFailed() from e

    return call


class SubnetManager(Protocol):
    def get_network_config(self) -> NetworkConfig:
        """Read and validate the network config. Raises ConfigError / StoreError."""
        ...

    def acquire_lease(
        self,
        attrs: LeaseAttrs,
        previous_subnet: IPv4Network | None,
        pools: Sequence[Pool] | None = None,
        cluster: str | None = None,
        previous_ipv6_subnet: IPv6Network | None = None,
    ) -> Lease:
        """Reuse or create our (first) lease, Flannel's order; ``pools`` None: the
        config's Network alone; ``previous_*``: subnet.env's FLANNEL_SUBNET and
        FLANNEL_IPV6_SUBNET. Raises PoolExhausted / StoreError."""
        ...

    def create_lease(self, attrs: LeaseAttrs, pools: Sequence[Pool], cluster: str | None) -> Lease:
        """Another lease for this node, in an eligible pool (etcd mode only: in
        Kubernetes mode the controller-manager owns pod CIDRs). Raises PoolExhausted,
        StoreError, or ConfigError where pools do not apply."""
        ...

    def release_lease(self, lease: Lease) -> bool:
        """Delete our lease (only if still ours). True if it went."""
        ...

    def renew_lease(self, lease: Lease) -> Lease:
        """Extend the lease's expiry and rewrite its attrs. Raises StoreError."""
        ...

    def watch_leases(self, on_leases: LeasesCallback, stop: threading.Event) -> None:
        """Block until ``stop`` is set: list, then watch, re-listing on compaction and
        reconnecting with backoff. Store outages never end the call; they are retried."""
        ...

    def undecodable(self) -> Mapping[str, Rejection]:
        """Values in the store that are no lease at all (by lease key), as last seen: the
        agent reports them with the leases it rejects."""
        ...

    def close(self) -> None: ...


def first_snapshot(manager: SubnetManager, timeout: float) -> Mapping[str, Lease]:
    """Every lease, from the first callback of ``watch_leases`` (all a manager promises)."""
    leases: dict[str, Lease] = {}
    got = threading.Event()
    stop = threading.Event()
    failure: list[BaseException] = []

    def on_leases(snapshot: Mapping[str, Lease], _revision: int) -> None:
        if not got.is_set():
            leases.update(snapshot)
            got.set()
        stop.set()

    def watch() -> None:
        try:
            manager.watch_leases(on_leases, stop)
        except BaseException as e:  # handed to the caller
            failure.append(e)
            got.set()

    thread = threading.Thread(target=watch, name="doctor-leases", daemon=True)
    thread.start()
    got.wait(timeout)
    stop.set()
    thread.join(timeout)
    if failure:
        raise failure[0]
    if not leases and not got.is_set():
        raise StoreUnavailable(
            f"no lease list from the store within {timeout:g} s; check that it is reachable"
        )
    return leases
