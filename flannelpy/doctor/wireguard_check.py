"""The doctor's WireGuard line: which implementation runs, and whether the device has
the key and the peers the plan asks for (pure: facts in, findings out)."""

from __future__ import annotations

from flannelpy.backend.wireguard import WireguardBackend, unencrypted_peers
from flannelpy.doctor.facts import Finding, NodeFacts
from flannelpy.doctor.plan import Plan
from flannelpy.doctor.report import listed


def check_wireguard(facts: NodeFacts, plan: Plan) -> list[Finding]:
    if not isinstance(plan.backend, WireguardBackend):
        return []
    wg = facts.wireguard
    if wg is None or wg.implementation is None or wg.device is None:
        why = wg.error if wg is not None and wg.error else "not found"
        return [Finding("error", "wireguard", f"the WireGuard device is not readable: {why}",
                        "check that the agent runs; see its log for wireguard-go")]  # fmt: skip
    runs = "userspace (wireguard-go" + (f" pid {wg.pid})" if wg.pid else ")")
    if wg.implementation == "kernel":
        runs = "the kernel module"
    own = list(plan.own_all)
    key = own[0].attrs.backend_data.get("PublicKey") if own and own[0].attrs.backend_data else None
    spec = plan.backend.device_spec(plan.ctx, own, list(plan.peers), key)
    wanted = {peer.public_key: peer for peer in spec.peers}
    missing = [k for k, peer in wanted.items() if wg.device.peers.get(k) != peer]
    extra = [k for k in wg.device.peers if k not in wanted]
    if missing or extra:
        what = []
        if missing:
            what.append(f"{len(missing)} peer(s) missing or different ({listed(missing)})")
        if extra:
            what.append(f"{len(extra)} peer(s) not in any lease ({listed(extra)})")
        return [Finding("error", "wireguard",
                        f"WireGuard runs in {runs}, but its device has {'; '.join(what)}",
                        "the agent repairs this within a second; if it stays, see its log")]
    findings = [Finding("ok", "wireguard", f"WireGuard runs in {runs} with all "
                        f"{len(wanted)} peer(s) as the leases say")]  # fmt: skip
    plain = unencrypted_peers(plan.ctx, own, list(plan.peers))
    if plain:
        findings.append(Finding(
            "warning", "wireguard", f"{plain} peer node(s) are still reached without "
            "encryption (through vxlan): the switch to wireguard is not complete",
            "roll wireguard out to the remaining nodes",
        ))  # fmt: skip
    return findings
