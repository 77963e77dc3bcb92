"""The doctor's lease checks (pure): whether this node holds its subnet alone and renews
it in time, and which peer leases the agent ignores as invalid."""

from __future__ import annotations

from collections.abc import Mapping

from flannelpy.doctor.facts import (
    LEASE_CRITICAL_SECONDS,
    RENEW_SLACK_SECONDS,
    Finding,
    NodeFacts,
)
from flannelpy.doctor.plan import Plan
from flannelpy.doctor.report import duration, listed
from flannelpy.subnet.lease import Lease


def check_lease(facts: NodeFacts, plan: Plan) -> list[Finding]:
    if plan.own is None:
        return [
            Finding(
                "error",
                "lease",
                f"this node ({plan.ctx.node_name}, {plan.ctx.public_ip}) holds no lease: "
                "it has no subnet, so no pod here can be reached",
                "start the agent (or look at its log for why it cannot acquire a lease)",
            )
        ]
    return [*_twin_leases(facts, plan), _lease_expiry(facts, plan.own)]


def _twin_leases(facts: NodeFacts, plan: Plan) -> list[Finding]:
    """Other leases with this node's address: peers send those subnets' traffic here."""
    own_keys = {lease.key for lease in plan.own_all}
    # IPv6-only, a node is known by its IPv6 address (its leases have no IPv4 one).
    address = plan.ctx.public_ip if plan.ctx.config.enable_ipv4 else plan.ctx.public_ipv6
    if address is None:
        return []
    twins = [
        lease
        for lease in facts.leases
        if lease.key not in own_keys and address in (lease.attrs.public_ip, lease.attrs.public_ipv6)
    ]
    if not twins:
        return []
    names = ", ".join(str(t.primary_subnet) for t in twins)
    return [
        Finding(
            "warning",
            "lease",
            f"{len(twins)} other lease(s) advertise this node's address {address} "
            f"({names}): leftovers of an earlier run; peers route those subnets here",
            "delete the stale lease key(s) from etcd",
            names,
        )
    ]


def _lease_expiry(facts: NodeFacts, own: Lease) -> Finding:
    """How long this node's lease has left, against when the agent should renew it."""
    held = own.primary_subnet
    ttl = facts.own_lease_ttl
    margin = facts.settings.subnet_lease_renew_margin * 60.0
    if facts.settings.kube_subnet_mgr:
        return Finding("ok", "lease", f"{held} held (the Node's podCIDR; it does not expire)")
    if own.store_lease_id is None:
        return Finding("ok", "lease", f"{held} is a reservation (never expires)")
    if ttl is None:
        return Finding("ok", "lease", f"{held} held; its expiry could not be read")
    if ttl < LEASE_CRITICAL_SECONDS:
        return Finding(
            "error",
            "lease",
            f"{held} expires in {duration(ttl)}: the agent is not renewing it, and when it "
            "expires another node may take the subnet",
            "start the agent or look at its log for renewal errors",
            str(held),
        )
    if ttl < margin - RENEW_SLACK_SECONDS:
        return Finding(
            "warning",
            "lease",
            f"{held} expires in {duration(ttl)}, past the renewal point "
            f"({duration(margin)} before expiry): renewals are failing",
            "look at the agent log for renewal errors and at the store's health",
            str(held),
        )
    return Finding("ok", "lease", f"{held} held, expires in {duration(ttl)}")


def check_peer_leases(facts: NodeFacts, plan: Plan | str) -> list[Finding]:
    """Peer leases the agent ignores (outside the networks, over this node's subnets or
    addresses, a bogus PublicIP, malformed values): as the agent reports them in
    status.json's ``rejected_leases``, and as the doctor judges the store's leases."""
    found: dict[str, str] = {}
    reported = (facts.status or {}).get("rejected_leases")
    if isinstance(reported, list):
        for item in reported[:1000]:
            if isinstance(item, Mapping) and isinstance(item.get("key"), str):
                found[item["key"]] = str(item.get("reason") or "invalid")
    if not isinstance(plan, str):
        for rejection in plan.rejected:
            found.setdefault(rejection.key, rejection.reason)
    if not found:
        return [Finding("ok", "leases", "every peer lease is valid for this node")]
    items = [f"{key} ({reason})" for key, reason in sorted(found.items())]
    return [
        Finding(
            "warning",
            "leases",
            f"{len(found)} peer lease(s) ignored as invalid and never programmed: {listed(items)}",
            "delete or correct those keys in the store; the agent log says why each one "
            "was refused",
            subject=", ".join(sorted(found)),
        )
    ]
