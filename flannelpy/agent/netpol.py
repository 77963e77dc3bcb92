"""NetworkPolicy, the writer's concern: the store's policy inputs -> this node's table.

The store's watches keep the parsed policies, pods and namespaces of the cluster and
call :meth:`NetworkPolicySync.changed` from their threads; it puts one
``PolicyInputsChanged`` on the writer's queue unless one is waiting already, so a burst of
changes costs one compile. The writer then calls :meth:`take`: once every kind has been
listed since the start, the pure compiler and renderer give the node's table, which
goes into ``NodeState.policy`` and from the next plan to the reconciler. Before that
first full sync the table stays None and the kernel keeps whatever it holds (a restart
opens no window).

The CNI side tells :meth:`NetworkPolicySync.on_cni` of each pod it attaches or detaches
(namespace/name from ``CNI_ARGS``, addresses from the ADD's result): a pod attached
before its Pod object shows its addresses is denied where its namespace has a policy
(``compile_node``'s ``attached``), instead of open until the watch brings it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from ipaddress import ip_interface

from flannelpy.agent.events import PolicyInputsChanged
from flannelpy.agent.state import NodeState, PolicyStatus
from flannelpy.cni.spec import parse_cni_args
from flannelpy.netpol.compile import compile_node
from flannelpy.netpol.model import Addr
from flannelpy.netpol.nft import Ruleset, render
from flannelpy.observe.policy_metrics import PolicyReading
from flannelpy.store.policy_inputs import PolicySnapshot, PolicySource

log = logging.getLogger("flannelpy.agent.netpol")


class NetworkPolicySync:
    def __init__(
        self, state: NodeState, source: PolicySource, put: Callable[[PolicyInputsChanged], None]
    ) -> None:
        self.state = state
        self.source = source
        self._put = put
        self._lock = threading.Lock()
        self._waiting = False  # a PolicyInputsChanged is on the queue, not handled yet
        self.synced = False
        self.compiles = 0
        self.last: PolicySnapshot | None = None
        self.table: Ruleset | None = None  # the last compiled; replaced whole, never changed
        # Pods the CNI side attached: namespace/name -> (container ID, addresses).
        self._attached: dict[str, tuple[str, tuple[Addr, ...]]] = {}

    def changed(self) -> None:
        """The watches' callback (any thread): one event on the queue at a time."""
        with self._lock:
            if self._waiting:
                return
            self._waiting = True
        self._put(PolicyInputsChanged())

    def on_cni(
        self, env: Mapping[str, str], stdin: bytes, netns_fd: int | None, result: bytes
    ) -> None:
        """A pod listener (the CNI server's thread): remember each attached pod's addresses
        until its DEL, and have the table compiled again."""
        args = parse_cni_args(env.get("CNI_ARGS", ""))
        namespace, name = args.get("K8S_POD_NAMESPACE"), args.get("K8S_POD_NAME")
        container, command = env.get("CNI_CONTAINERID", ""), env.get("CNI_COMMAND")
        if not namespace or not name:
            return  # not a Kubernetes pod: no policy can select it
        key = f"{namespace}/{name}"
        with self._lock:
            if command == "ADD":
                doc = json.loads(result)  # our own handler's result: cniVersion 1.x
                ips = tuple(ip_interface(i["address"]).ip for i in doc.get("ips", []))
                self._attached[key] = (container, ips)
            elif command == "DEL" and self._attached.get(key, ("",))[0] == container:
                del self._attached[key]  # a DEL of an older sandbox leaves the new one
            else:
                return
        self.changed()

    def take(self) -> bool:
        """The writer's step: whether the node's table changed (a replan is due)."""
        with self._lock:
            self._waiting = False  # a change after the snapshot below queues a new event
            attached = {key: ips for key, (_, ips) in self._attached.items()}
        snapshot = self.source.snapshot()
        self.last = snapshot
        self.state.policy_status = _status(snapshot, None, self.table)
        if not snapshot.synced:
            return False
        try:
            compiled = compile_node(
                snapshot.policies,
                snapshot.pods,
                snapshot.namespaces,
                self.state.ctx.node_name,
                attached,
            )
            table: Ruleset = render(compiled)
        except Exception:  # a bug: keep enforcing the last table rather than stop the node
            log.exception("policy compile failed; the last table stays")
            return False
        self.compiles += 1
        self.table = table
        self.state.policy_status = _status(snapshot, len(compiled.pods), table)
        if not self.synced:
            self.synced = True
            log.info(
                "network policy synced policies=%d pods=%d namespaces=%d",
                len(snapshot.policies),
                len(snapshot.pods),
                len(snapshot.namespaces),
            )
        if table == self.state.policy:
            return False
        self.state.policy = table
        return True

    def reading(self, counters: Callable[[str], Mapping[str, int]]) -> PolicyReading | None:
        """What ``/metrics`` shows (any thread): None before the first compile; the
        kernel's named counters (``counters(table)``) by the labels the table gave them."""
        table, status = self.table, self.state.policy_status
        if table is None or status is None:
            return None
        counted = counters(table.table)
        denied = {
            name: ((c.namespace, c.policy, c.direction), counted[name])
            for name, c in table.counters.items()
            if name in counted
        }
        return PolicyReading(status.policies, status.selected_pods, status.set_elements, denied)


def _status(snapshot: PolicySnapshot, selected: int | None, table: Ruleset | None) -> PolicyStatus:
    return PolicyStatus(
        synced=snapshot.synced and selected is not None,
        policies=len(snapshot.policies),
        pods=len(snapshot.pods),
        namespaces=len(snapshot.namespaces),
        selected_pods=selected or 0,
        set_elements=0 if table is None else sum(len(s.elements) for s in table.sets.values()),
        refused=snapshot.refused[:20],
    )
