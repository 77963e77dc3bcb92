"""CNI CHECK: does a pod's attachment still look as ADD left it?

CHECK failures use code 999, as the reference plugins' do (the spec defines no code for
"the attachment is broken"). A pod attached before flannelpy took the node over
(Flannel's plugin, host-local's address, held by our IPAM) has no record: CHECK checks
it against the runtime's prevResult and the held address, and is refused without a
prevResult, as the reference bridge plugin refuses it.
"""

from __future__ import annotations

from ipaddress import ip_interface

from flannelpy.cni import netconf
from flannelpy.cni.context import CommandContext
from flannelpy.cni.failures import cni_errors
from flannelpy.cni.records import Record
from flannelpy.cni.spec import CniError, Code, Request, parse_result
from flannelpy.dataplane.podnames import IPInterface, gateway_of

CHECK_FAILED = Code.INTERNAL


class CheckCommand(CommandContext):
    def check(self, req: Request, netns_fd: int | None = None) -> None:
        key = (req.container_id, req.ifname)
        with self.locks.hold(key):
            record = self.records.read(req.network_name, *key)
            if record is None and self._held_addresses(*key):
                problems = self._check_held(req, netns_fd)
            elif record is None:
                raise CniError(
                    Code.UNKNOWN_CONTAINER,
                    f"network {req.network_name} has no attachment for container"
                    f" {req.container_id} interface {req.ifname}; run ADD first",
                )
            else:
                problems = self._check_record(req, record, netns_fd)
        if problems:
            raise CniError(CHECK_FAILED, "; ".join(problems))

    def _check_record(self, req: Request, record: Record, netns_fd: int | None) -> list[str]:
        problems = []
        if record.netns != req.netns:
            problems.append(f"the attachment was made in {record.netns}, not {req.netns}")
        assigned = {a.interface for a in self.ipam.find_all(req.container_id, req.ifname)}
        for address in record.addresses:
            if address not in assigned:
                problems.append(f"IPAM no longer assigns {address} to this container")
        families = [a.version for a in record.addresses]
        destinations = netconf.destinations(req, self.settings, families)
        routes = [
            (dst, gw)
            for address, gw in zip(record.addresses, record.gateways, strict=True)
            for dst in destinations
            if dst.version == address.version
        ]
        with cni_errors():
            problems += self.pods.check_pod(
                req.netns,
                req.ifname,
                record.host_veth,
                record.bridge,
                record.addresses,
                routes,
                self.settings.mtu_provider(),
                netns_fd=netns_fd,
            )
        return problems

    def _held_addresses(self, container_id: str, ifname: str) -> list[IPInterface]:
        """The addresses (one per family) a pod made before a migration holds (host-local
        gave them; the agent holds them, see NodeIpam.hold_foreign), with their lease's
        prefix; [] when it holds none or IPAM assigned it addresses itself."""
        if self.ipam.find(container_id, ifname) is not None:
            return []
        ips = [
            e.ip
            for e in self.ipam.host_local_entries()
            if (e.container_id, e.ifname) == (container_id, ifname)
        ]
        subnets = [a.subnet for a in self.ipam.accounting()]
        held: list[IPInterface] = []
        for ip in ips:
            subnet = next((s for s in subnets if ip in s), None)
            if subnet is not None:
                held.append(ip_interface((ip, subnet.prefixlen)))
        return held

    def _check_held(self, req: Request, netns_fd: int | None) -> list[str]:
        """CHECK of a pod the previous plugin (Flannel's, delegating to bridge and
        host-local) attached: no record of ours, but the held address and the runtime's
        prevResult (the spec has the plugin consult it) say what to expect. Its host veth
        has the bridge plugin's name, known only from the prevResult."""
        held = self._held_addresses(req.container_id, req.ifname)
        assert held  # checked by the caller, under the key's lock
        if req.prev_result is None:
            raise CniError(
                CHECK_FAILED,
                f"container {req.container_id} was attached before flannelpy took the node"
                " over and CHECK carries no prevResult to check it against; pass the"
                " cached ADD result as prevResult",
            )
        with cni_errors():
            prev = parse_result(req.prev_result, req.cni_version)
        bridge = netconf.bridge_name(req, self.settings)
        problems = []
        host = next((i.name for i in prev.interfaces if not i.sandbox and i.name != bridge), None)
        sandbox = next((i.sandbox for i in prev.interfaces if i.sandbox), req.netns)
        if sandbox != req.netns:
            problems.append(f"the attachment was made in {sandbox}, not {req.netns}")
        named = {ip_interface(ip.address) for ip in prev.ips}  # parse_result checked them
        for address in held:
            if address not in named:
                shown = ", ".join(ip.address for ip in prev.ips) or "no address"
                problems.append(f"prevResult names {shown}, but IPAM holds {address} for it")
        if host is None:
            problems.append(f"prevResult names no host veth on {bridge}")
            return problems
        gateways = {a.version: gateway_of(a.network).ip for a in held}
        destinations = netconf.destinations(req, self.settings, sorted(gateways))
        routes = [(dst, gateways[dst.version]) for dst in destinations]
        with cni_errors():
            problems += self.pods.check_pod(
                req.netns,
                req.ifname,
                host,
                bridge,
                held,
                routes,
                self.settings.mtu_provider(),
                netns_fd=netns_fd,
            )
        return problems
