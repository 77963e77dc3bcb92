"""The doctor's WireGuard lines: which implementation runs, and whether each device
(``flannel-wg``, and ``flannel-wg-v6`` in dual stack) has the peers the plan asks for
(pure: facts in, findings out)."""

from __future__ import annotations

from flannelpy.backend import ipv6
from flannelpy.backend.wireguard import (
    WireguardBackend,
    plan_device_v6,
    unencrypted_peers,
    wireguard_peers_v6,
)
from flannelpy.backend.wireguard_config import DEVICE, DEVICE_V6
from flannelpy.dataplane.wgspec import WgDeviceSpec
from flannelpy.doctor.facts import Finding, NodeFacts, WireguardFacts
from flannelpy.doctor.plan import Plan
from flannelpy.doctor.report import listed


def check_wireguard(facts: NodeFacts, plan: Plan) -> list[Finding]:
    if not isinstance(plan.backend, WireguardBackend):
        return []
    own = list(plan.own_all)
    peers = list(plan.peers)
    key = own[0].attrs.backend_data.get("PublicKey") if own and own[0].attrs.backend_data else None
    findings: list[Finding] = []
    if plan.ctx.config.enable_ipv4:
        findings += _check_device(
            DEVICE, facts.wireguard, plan.backend.device_spec(plan.ctx, own, peers, key)
        )
    else:  # IPv6-only: the key is in BackendV6Data
        key = (
            own[0].attrs.backend_v6_data.get("PublicKey")
            if own and (own[0].attrs.backend_v6_data)
            else None
        )
    if ipv6.enabled(plan.ctx):
        backend = plan.backend
        spec6 = plan_device_v6(
            backend.config(plan.ctx),
            own,
            wireguard_peers_v6(plan.ctx, own, peers),
            key,
            backend.device_mtu_v6(plan.ctx),
        )
        findings += _check_device(DEVICE_V6, facts.wireguard_v6, spec6)
    if any(f.severity == "error" for f in findings):
        return findings
    plain = unencrypted_peers(plan.ctx, own, peers)
    if plain:
        findings.append(
            Finding(
                "warning",
                "wireguard",
                f"{plain} peer node(s) are still reached without "
                "encryption (through vxlan): the switch to wireguard is not complete",
                "roll wireguard out to the remaining nodes",
            )
        )
    return findings


def _check_device(name: str, wg: WireguardFacts | None, spec: WgDeviceSpec) -> list[Finding]:
    if wg is None or wg.implementation is None or wg.device is None:
        why = wg.error if wg is not None and wg.error else "not found"
        return [
            Finding(
                "error",
                "wireguard",
                f"the WireGuard device {name} is not readable: {why}",
                "check that the agent runs; see its log for wireguard-go",
            )
        ]
    runs = "userspace (wireguard-go" + (f" pid {wg.pid})" if wg.pid else ")")
    if wg.implementation == "kernel":
        runs = "the kernel module"
    wanted = {peer.public_key: peer for peer in spec.peers}
    missing = [k for k, peer in wanted.items() if wg.device.peers.get(k) != peer]
    extra = [k for k in wg.device.peers if k not in wanted]
    where = "WireGuard" if name == DEVICE else f"WireGuard's {name}"
    if missing or extra:
        what = []
        if missing:
            what.append(f"{len(missing)} peer(s) missing or different ({listed(missing)})")
        if extra:
            what.append(f"{len(extra)} peer(s) not in any lease ({listed(extra)})")
        return [
            Finding(
                "error",
                "wireguard",
                f"{where} runs in {runs}, but its device has {'; '.join(what)}",
                "the agent repairs this within a second; if it stays, see its log",
            )
        ]
    return [
        Finding(
            "ok",
            "wireguard",
            f"{where} runs in {runs} with all {len(wanted)} peer(s) as the leases say",
        )
    ]
