"""Helpers for pod tests: drive the installed CNI executable directly, as a runtime would.

``run_plugin`` runs ``<lab dir>/cni/bin/flannelpy`` inside a lab node's network
namespace with the ``CNI_*`` variables and a single-plugin config on stdin, and
records when the call started and ended (wall clock, the clock the agent stamps
its IPAM state with). ``pod_namespaces`` pre-creates pod namespaces under the
lab's name prefix (so ``lab down`` would sweep them too) and always removes them.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from typing import Any

from flannelpy_lab import Lab
from flannelpy_lab.pods import NETWORK_NAME, PLUGIN_NAME
from flannelpy_lab.state import NodeInfo

from tests.support.waiting import wait_until

CNI_VERSION = "1.0.0"
EXHAUSTED = re.compile(
    r"^no free address in (?P<subnet>\d+\.\d+\.\d+\.\d+/\d+): (?P<assigned>\d+) assigned, "
    r"(?P<cooling>\d+) cooling down(?: \(next free in (?P<next>\d+) s\))?$"
)
NETNS_WORKERS = 16
_INSTALL_LOCK = threading.Lock()


@dataclass(frozen=True)
class CniCall:
    """One run of the executable: what it printed, its exit code, and when."""

    command: str
    container_id: str
    netns: str
    returncode: int
    stdout: str
    stderr: str
    started: float  # time.time()
    ended: float

    @property
    def doc(self) -> dict[str, Any] | None:
        try:
            doc = json.loads(self.stdout)
        except json.JSONDecodeError:
            return None
        return doc if isinstance(doc, dict) else None

    @property
    def address(self) -> IPv4Interface:
        """The first address of an ADD result; fails the test if there is none."""
        doc = self.doc
        assert self.returncode == 0 and doc is not None, f"{self.command} failed: {self}"
        return IPv4Interface(doc["ips"][0]["address"])

    @property
    def error_code(self) -> int | None:
        doc = self.doc
        return doc.get("code") if doc is not None and self.returncode != 0 else None

    @property
    def error_msg(self) -> str:
        doc = self.doc
        return str(doc.get("msg", "")) if doc is not None else ""


@dataclass(frozen=True)
class Exhaustion:
    """The numbers an exhaustion error claims."""

    subnet: IPv4Network
    assigned: int
    cooling: int
    next_free_in: int | None


def parse_exhaustion(msg: str) -> Exhaustion | None:
    m = EXHAUSTED.match(msg)
    if m is None:
        return None
    return Exhaustion(
        IPv4Network(m["subnet"]),
        int(m["assigned"]),
        int(m["cooling"]),
        int(m["next"]) if m["next"] is not None else None,
    )


def executable(lab: Lab) -> str:
    """The installed CNI executable (installing it and the conflists if needed)."""
    with _INSTALL_LOCK:  # callers run in many threads; install once
        if "cni_exec" not in lab.state.extra:
            lab.install_cni()
    return os.path.join(lab.state.cni_bin_dir, PLUGIN_NAME)


def plugin_config(node: NodeInfo, **extra: Any) -> dict[str, Any]:
    """A single-plugin network config for our plugin on ``node`` (no portmap: fast)."""
    return {
        "cniVersion": CNI_VERSION,
        "name": NETWORK_NAME,
        "type": PLUGIN_NAME,
        "agentSocket": node.cni_socket,
        **extra,
    }


def run_plugin(
    lab: Lab,
    node: str,
    command: str,
    container_id: str,
    netns: str,
    config: dict[str, Any],
    ifname: str = "eth0",
    timeout: float = 60.0,
) -> CniCall:
    """Run the executable once inside ``node``'s namespace, as a runtime on it would."""
    info = lab.node(node)
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container_id,
        "CNI_NETNS": netns,
        "CNI_IFNAME": ifname,
        "CNI_PATH": lab.state.cni_path,
    }
    argv = ["nsenter", f"--net=/run/netns/{info.namespace}", executable(lab)]
    started = time.time()
    proc = subprocess.run(
        argv, input=json.dumps(config).encode(), env=env, capture_output=True, timeout=timeout
    )
    return CniCall(
        command,
        container_id,
        netns,
        proc.returncode,
        proc.stdout.decode(errors="replace"),
        proc.stderr.decode(errors="replace"),
        started,
        time.time(),
    )


def _ip_netns(*args: str) -> None:
    subprocess.run(["ip", "netns", *args], check=True, capture_output=True)


def create_namespaces(names: Sequence[str]) -> None:
    def create(name: str) -> None:
        _ip_netns("add", name)
        _ip_netns("exec", name, "ip", "link", "set", "lo", "up")

    with ThreadPoolExecutor(NETNS_WORKERS) as pool:
        list(pool.map(create, names))


def delete_namespaces(names: Sequence[str]) -> None:
    def delete(name: str) -> None:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)

    with ThreadPoolExecutor(NETNS_WORKERS) as pool:
        list(pool.map(delete, names))


@contextmanager
def pod_namespaces(lab: Lab, tag: str, count: int) -> Iterator[list[str]]:
    """``count`` fresh pod namespaces named ``fpl-<lab>-<tag><i>``; removed on exit."""
    names = [f"fpl-{lab.name}-{tag}{i}" for i in range(count)]
    try:
        create_namespaces(names)
        yield names
    finally:
        delete_namespaces(names)


def netns_path(name: str) -> str:
    return f"/run/netns/{name}"


def run_in(ns: str, argv: list[str], timeout: float = 15.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=timeout
    )


def ping(ns: str, target: IPv4Address | str, attempts: int = 3) -> bool:
    for _ in range(attempts):
        if run_in(ns, ["ping", "-c", "1", "-W", "1", str(target)]).returncode == 0:
            return True
    return False


def ipam_state(node: NodeInfo) -> dict[IPv4Network, dict[str, Any]]:
    """The agent's IPAM state files: subnet -> the pool document."""
    directory = os.path.join(node.node_dir, "state", "ipam")
    out: dict[IPv4Network, dict[str, Any]] = {}
    for name in os.listdir(directory):
        if name.endswith(".json") and not name.startswith("."):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                doc = json.load(f)
            out[IPv4Network(doc["subnet"])] = doc
    return out


def wait_released(node: NodeInfo, container_ids: Collection[str]) -> None:
    """Wait until none of ``container_ids`` holds an address in the IPAM state on disk.
    The agent answers a DEL once the pod's veth is gone and releases the address right
    after, under the attachment's lock: the state file follows within milliseconds."""
    wanted = set(container_ids)
    wait_until(
        lambda: not wanted & set(assigned_addresses(node)),
        10,
        what=f"the addresses of {sorted(wanted)} released after their DEL",
    )


def assigned_addresses(node: NodeInfo) -> dict[str, IPv4Address]:
    """container_id -> address, from the IPAM state on disk."""
    return {
        a["container_id"]: IPv4Address(a["ip"])
        for doc in ipam_state(node).values()
        for a in doc["allocations"]
    }


def usable_count(subnet: IPv4Network) -> int:
    """Addresses a lease hands to pods: all but network, gateway and broadcast."""
    return int(subnet.num_addresses) - 3


def node_lease(node: NodeInfo) -> IPv4Network:
    assert node.overlay_address, f"node {node.name} has no lease yet"
    return IPv4Interface(node.overlay_address).network


@dataclass
class LivePod:
    container_id: str
    netns: str  # path
    address: IPv4Interface


class PodFleet:
    """Pods on one node, created and deleted through the executable with a kubelet's
    bookkeeping: which pods live, which namespaces are free, every call made."""

    def __init__(
        self,
        lab: Lab,
        node: str,
        namespaces: Sequence[str],
        config: dict[str, Any],
        tag: str,
        after_failed_add: Callable[[CniCall], None] | None = None,
    ) -> None:
        self.lab = lab
        self.node = node
        self.config = config
        self.tag = tag
        self.after_failed_add = after_failed_add  # runs in the worker, right after the call
        self.live: deque[LivePod] = deque()
        self.spare: list[str] = [netns_path(n) for n in namespaces]
        self.calls: list[CniCall] = []
        self.addresses: dict[str, IPv4Interface] = {}  # container ID -> address it got
        self.in_flight = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # live or in_flight changed
        self._next = 0

    def _new_id(self) -> str:
        with self._lock:
            self._next += 1
            return f"{self.lab.name}-{self.tag}-{self._next}"

    def _call(self, command: str, container_id: str, netns: str) -> CniCall:
        call = run_plugin(self.lab, self.node, command, container_id, netns, self.config)
        with self._lock:
            self.calls.append(call)
        return call

    def add(self, netns: str | None = None) -> CniCall:
        """ADD a new pod into ``netns`` (default: a spare namespace); a failed ADD's
        namespace goes back to the spares."""
        if netns is None:
            with self._lock:
                netns = self.spare.pop()
        call = self._call("ADD", self._new_id(), netns)
        if call.returncode != 0 and self.after_failed_add is not None:
            self.after_failed_add(call)
        with self._lock:
            if call.returncode == 0:
                self.live.append(LivePod(call.container_id, netns, call.address))
                self.addresses[call.container_id] = call.address
                self._changed.notify_all()
            else:
                self.spare.append(netns)
        return call

    def delete(self, pod: LivePod) -> CniCall:
        """DEL ``pod``; its namespace becomes spare once the call returns."""
        call = self._call("DEL", pod.container_id, pod.netns)
        with self._lock:
            self.spare.append(pod.netns)
        return call

    def replace_oldest(self, target: int) -> list[CniCall]:
        """One churn step, as a deployment's rollout does: DEL the oldest pod (unless
        failures left fewer than ``target`` pods), then ADD a new one in its namespace."""
        with self._changed:
            # When every pod is mid-replacement (slow calls pile up), wait for one to be
            # live rather than surge past the target; failed ADDs shrink the count.
            while not self.live and self.in_flight >= target:
                self._changed.wait()
            victim = self.live.popleft() if len(self.live) + self.in_flight >= target else None
            self.in_flight += 1
        try:
            calls = []
            netns = None
            if victim is not None:
                calls.append(self._call("DEL", victim.container_id, victim.netns))
                netns = victim.netns
            calls.append(self.add(netns))
            return calls
        finally:
            with self._changed:
                self.in_flight -= 1
                self._changed.notify_all()

    def churn(self, target: int, steps: int, seconds: float, workers: int = 128) -> None:
        """``steps`` churn steps started at an even pace over ``seconds`` (open loop:
        a slow step does not delay the next one)."""
        start = time.monotonic()
        with ThreadPoolExecutor(workers) as pool:
            futures = []
            for i in range(steps):
                delay = start + i * seconds / steps - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(self.replace_oldest, target))
            for f in futures:
                f.result()

    def burst(self, count: int, workers: int = 100) -> list[CniCall]:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda _: self.add(), range(count)))

    def delete_all(self, workers: int = 64) -> list[CniCall]:
        with self._lock:
            pods = list(self.live)
            self.live.clear()
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(self.delete, pods))


def calls_of(calls: Sequence[CniCall], command: str) -> list[CniCall]:
    return [c for c in calls if c.command == command]


def reuse_violations(
    calls: Sequence[CniCall], addresses: dict[str, IPv4Interface], cooldown: float
) -> list[str]:
    """Every address handed to a pod while another still held it or within ``cooldown``
    seconds of its release, judged from the calls' start and end times alone.

    An address's owners, in the order their ADDs returned, must each have been
    DELeted, and the next owner's ADD must have returned at least ``cooldown``
    after that DEL began (the release happens inside the DEL, the allocation
    inside the ADD, so that bound holds whenever the agent obeyed cooldown).
    """
    dels = {c.container_id: c for c in calls_of(calls, "DEL") if c.returncode == 0}
    owners: dict[IPv4Address, list[CniCall]] = {}
    for add in calls_of(calls, "ADD"):
        if add.returncode == 0:
            owners.setdefault(add.address.ip, []).append(add)
    found = []
    for ip, adds in owners.items():
        adds.sort(key=lambda c: c.ended)
        for before, after in itertools.pairwise(adds):
            released = dels.get(before.container_id)
            if released is None or after.ended - released.started < cooldown:
                gap = (
                    "never released"
                    if released is None
                    else (f"released {after.ended - released.started:.2f} s before")
                )
                found.append(
                    f"{ip} went to {after.container_id} while {before.container_id}"
                    f" held it or {gap}"
                )
    return found


def free_since(node: NodeInfo, since: float, cooldown: float) -> list[IPv4Address]:
    """Addresses the IPAM state on disk shows free (unassigned, and never used or
    released at least ``cooldown`` before ``since``) throughout from ``since`` on."""
    free = []
    for subnet, doc in ipam_state(node).items():
        assigned = {IPv4Address(a["ip"]) for a in doc["allocations"]}
        released = {IPv4Address(r["ip"]): float(r["released_at"]) for r in doc["released"]}
        for ip in list(subnet.hosts())[1:]:  # the first host address is the gateway
            at = released.get(ip)
            if ip not in assigned and (at is None or at + cooldown <= since):
                free.append(ip)
    return free


def in_use(node: NodeInfo, cooldown: float, now: float) -> int:
    """Assigned plus cooling addresses in the IPAM state on disk at ``now``."""
    total = 0
    for doc in ipam_state(node).values():
        total += len(doc["allocations"])
        total += sum(1 for r in doc["released"] if float(r["released_at"]) + cooldown > now)
    return total


def in_use_per_lease(node: NodeInfo, cooldown: float, now: float) -> dict[IPv4Network, int]:
    """Assigned plus cooling addresses per lease in the IPAM state on disk at ``now``
    (a lease whose state file does not exist yet is missing: nothing in use)."""
    return {
        subnet: len(doc["allocations"])
        + sum(1 for r in doc["released"] if float(r["released_at"]) + cooldown > now)
        for subnet, doc in ipam_state(node).items()
    }


def run_conflist(
    conflist: dict[str, Any],
    cni_path: str,
    node_netns: str,
    command: str,
    container_id: str,
    netns: str,
    prev: dict[str, Any] | None = None,
    ifname: str = "eth0",
) -> dict[str, Any] | None:
    """A container runtime in a few lines, independent of the lab's: ADD runs the
    plugins in order passing prevResult on, DEL in reverse with the ADD's result.
    Returns the final result of ADD; raises AssertionError naming a failed plugin."""
    plugins = conflist["plugins"] if command == "ADD" else list(reversed(conflist["plugins"]))
    result = prev
    for plugin in plugins:
        conf = {**plugin, "cniVersion": conflist["cniVersion"], "name": conflist["name"]}
        if result is not None:
            conf["prevResult"] = result
        binary = next(
            os.path.join(d, plugin["type"])
            for d in cni_path.split(":")
            if os.access(os.path.join(d, plugin["type"]), os.X_OK)
        )
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": container_id,
            "CNI_NETNS": netns,
            "CNI_IFNAME": ifname,
            "CNI_PATH": cni_path,
        }
        proc = subprocess.run(
            ["ip", "netns", "exec", node_netns, binary],
            input=json.dumps(conf).encode(),
            env=env,
            capture_output=True,
            timeout=60,
        )
        assert proc.returncode == 0, f"{command} of {plugin['type']} failed: {proc.stdout!r}"
        if command == "ADD":
            result = json.loads(proc.stdout)
    return result
