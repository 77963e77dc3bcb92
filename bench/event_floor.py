"""The floor of a Python agent's lease event: the least work any agent in this interpreter
does per lease, run by ``bench.lease_events --floor`` beside ours and flanneld.

    python -m bench.event_floor --etcd-endpoint URL --prefix P --subnet-file F --local IP

What it does is what a lease event demands and nothing else: one watch of the prefix
over etcd's JSON gateway (urllib3, as ours), and per event a JSON line decoded, the key
and value taken out of base64, the lease's JSON read for its public IP and VTEP MAC,
and the peer's neighbour, FDB entry and route written (or deleted) in one netlink send
through the agent's own message packing (``flannelpy.dataplane.rtnl``, ``nlbatch``).
No validation, no plan, no second thread, no reconcile, no status, no metrics, no
prober: it is not an agent, it is the interpreter's cost of the event's I/O. At start it
makes ``flannel.1`` and programs every lease of the range the same way, then writes the
subnet file (the benchmark's sign of ready).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from ipaddress import IPv4Address, IPv4Network

import urllib3

from flannelpy.dataplane import nlbatch as nl
from flannelpy.dataplane import rtnl
from flannelpy.store.etcd.member import b64, prefix_end, unb64
from flannelpy.store.http import Stream

DEVICE = "flannel.1"
PROTOCOL = 3  # RTPROT_BOOT, as `ip route` writes


class Floor:
    def __init__(self, endpoint: str, prefix: str) -> None:
        self.http = urllib3.PoolManager()
        self.endpoint = endpoint.rstrip("/")
        self.prefix = prefix
        self.sock = nl.NetlinkSocket()
        self.ifindex = 0
        self.peers: dict[str, tuple[IPv4Network, IPv4Address, str]] = {}

    def close(self) -> None:
        self.sock.close()
        self.http.clear()

    def requests(self, key: str, value: bytes | None) -> list[rtnl.Request]:
        """A put's three writes (neighbour, FDB, route), or a delete's three removals."""
        if value is None:
            known = self.peers.pop(key, None)
            if known is None:
                return []
            subnet, public_ip, mac = known
            delete = True
        else:
            lease = json.loads(value)
            subnet = IPv4Network(key[len(self.prefix) :].replace("-", "/"))
            public_ip = IPv4Address(lease["PublicIP"])
            mac = lease["BackendData"]["VtepMAC"]
            self.peers[key] = (subnet, public_ip, mac)
            delete = False
        gateway = subnet.network_address
        return [
            rtnl.route_request(
                delete,
                PROTOCOL,
                subnet.network_address.packed,
                subnet.prefixlen,
                gateway=gateway,
                oif=self.ifindex,
                onlink=True,
            ),
            rtnl.neigh_request(delete, self.ifindex, gateway, None if delete else mac),
            rtnl.fdb_request(delete, self.ifindex, mac, public_ip),
        ][:: 1 if delete else -1]  # a route last on the way in, first on the way out

    def start(self, local: str) -> int:
        subprocess.run(["ip", "link", "del", DEVICE], capture_output=True, check=False)
        vxlan = ["type", "vxlan", "id", "1", "local", local, "dstport", "8472", "nolearning"]
        subprocess.run(["ip", "link", "add", DEVICE, *vxlan], check=True)
        subprocess.run(["ip", "link", "set", DEVICE, "up"], check=True)
        link = nl.get_link(self.sock, DEVICE)
        assert link is not None
        self.ifindex = link.index
        doc = self._post("/v3/kv/range", self._range())
        batch = []
        for kv in doc.get("kvs", []):
            batch += self.requests(unb64(kv["key"]).decode(), unb64(kv["value"]))
        self.sock.batch(batch)
        return int(doc["header"]["revision"])

    def _range(self) -> dict[str, str]:
        """The prefix as etcd's JSON gateway takes a key range."""
        return {"key": b64(self.prefix), "range_end": b64(prefix_end(self.prefix.encode()))}

    def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        resp = self.http.request("POST", self.endpoint + path, body=json.dumps(body).encode())
        doc: dict[str, object] = json.loads(resp.data)
        return doc

    def watch(self, revision: int) -> None:
        body = {"create_request": {**self._range(), "start_revision": revision + 1}}
        resp = self.http.request(
            "POST",
            self.endpoint + "/v3/watch",
            body=json.dumps(body).encode(),
            preload_content=False,
            timeout=urllib3.Timeout(connect=5, read=None),
        )
        for line in Stream(resp).lines():  # the agent's own line splitting
            if line.strip():
                self.on_message(json.loads(line))

    def on_message(self, message: dict[str, object]) -> None:
        result = message.get("result")
        if not isinstance(result, dict):
            return
        batch = []
        for event in result.get("events", ()):
            kv = event["kv"]
            value = None if event.get("type") == "DELETE" else unb64(kv["value"])
            batch += self.requests(unb64(kv["key"]).decode(), value)
        if batch:
            self.sock.batch(batch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.event_floor", description=__doc__)
    parser.add_argument("--etcd-endpoint", required=True)
    parser.add_argument("--prefix", required=True, help="the subnets' prefix, ending in /")
    parser.add_argument("--subnet-file", required=True)
    parser.add_argument("--local", required=True, help="the VTEP's underlay address")
    args = parser.parse_args(argv)
    floor = Floor(args.etcd_endpoint, args.prefix)
    revision = floor.start(args.local)
    with open(args.subnet_file, "w", encoding="utf-8") as f:
        f.write("FLANNEL_SUBNET=0.0.0.0/32\n")  # the benchmark's sign of ready only
    floor.watch(revision)  # until the benchmark's SIGTERM
    return 0


if __name__ == "__main__":
    sys.exit(main())
