"""Kubernetes Services over the overlay, on the kubelet lab with kube-proxy.

Three backends (``web-n1``..``web-n3``, one bare pod per node) run busybox ``httpd``
with a CGI that answers ``<pod name> <client address as the pod sees it>``, so every
answer says which backend served it and whether its source was translated. Clients
are the lab's test Deployment's pods (one per node), through ``kubectl exec``, and the
nodes themselves, from their network namespaces; each sends a counted loop of
requests (``wget`` under ``timeout``) and every answer is parsed.

Services:

- ``web``: NodePort (and so ClusterIP) over the three backends;
- ``web-n1``: ClusterIP over ``web-n1`` alone, which ``web-n1`` calls (hairpin);
- ``web-local``: NodePort over ``web-n1`` alone with ``externalTrafficPolicy: Local``;

and a fourth backend, ``web-hostport`` on n3, in no Service, its port published on its
node with ``hostPort`` (the conflist's ``portmap``).
"""

from __future__ import annotations

import collections
import json
import shlex
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from typing import Any

from flannelpy_lab import Lab, images, kubelet

from tests.support.lab_util import wait_until

NODES = ("n1", "n2", "n3")
PORT = 8080
REQUEST_TIMEOUT = 2  # seconds for one request (busybox-static's wget -T crashes: timeout)
# The CGI the backends run: the pod's name (its hostname) and the client's address.
WHO_CGI = (
    "#!/bin/sh\n"
    'printf \'Content-Type: text/plain\\r\\n\\r\\n%s %s\\n\' "$(hostname)" "$REMOTE_ADDR"\n'
)
SERVE = (
    'mkdir -p /www/cgi-bin && echo "$WHO_CGI" > /www/cgi-bin/who && '
    f"chmod +x /www/cgi-bin/who && exec httpd -f -p {PORT} -h /www"
)
PATH = "/cgi-bin/who"
HOST_PORT, HOST_PORT_NODE, HOST_PORT_POD = 18080, "n3", "web-hostport"


def backend(node: str, name: str | None = None, host_port: int | None = None) -> dict[str, Any]:
    """A backend pod bound to ``node`` (no scheduler: where it runs is the test's); with
    ``host_port``, outside the Services, its port published on the node (``hostPort``,
    which the conflist's ``portmap`` plugin sets up)."""
    labels = {"app": "hostport"} if host_port else {"app": "web", "node": node}
    port: dict[str, Any] = {"containerPort": PORT}
    if host_port:
        port["hostPort"] = host_port
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name or f"web-{node}", "labels": labels},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "httpd",
                    "image": images.BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", SERVE],
                    "env": [{"name": "WHO_CGI", "value": WHO_CGI}],
                    "ports": [port],
                    "readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 1},
                }
            ],
        },
    }


def service(name: str, selector: dict[str, str], kind: str, local: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "type": kind,
        "selector": selector,
        "ports": [{"port": 80, "targetPort": PORT, "protocol": "TCP"}],
    }
    if local:
        spec["externalTrafficPolicy"] = "Local"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


SERVICES = (
    service("web", {"app": "web"}, "NodePort"),
    service("web-n1", {"app": "web", "node": "n1"}, "ClusterIP"),
    service("web-local", {"app": "web", "node": "n1"}, "NodePort", local=True),
)


@dataclass
class Answers:
    """What came back from one loop of requests."""

    sent: int
    by: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)

    @property
    def answered(self) -> int:
        return sum(self.by.values())

    @property
    def backends(self) -> set[str]:
        return {b for b, _ in self.by}

    @property
    def sources(self) -> set[str]:
        return {s for _, s in self.by}

    def summary(self) -> str:
        spread = dict(collections.Counter(b for b, _ in self.by.elements()))
        return f"{self.answered}/{self.sent} answered, by {spread}, sources {sorted(self.sources)}"


def parse(output: str, sent: int) -> Answers:
    """One line per request: ``<backend> <source>``, or ``FAIL``."""
    answers = Answers(sent)
    for line in output.splitlines():
        words = line.split()
        if len(words) == 2 and words[0].startswith("web-"):
            answers.by[(words[0], client_address(words[1]))] += 1
    return answers


def client_address(remote: str) -> str:
    """httpd's REMOTE_ADDR as a plain address: it listens on a dual-stack socket, so an
    IPv4 client shows as ``[::ffff:10.244.2.2]``."""
    return remote.strip("[]").removeprefix("::ffff:")


def loop(url: str, count: int, wget: str) -> str:
    """A shell loop of ``count`` requests to ``url``, one line printed per request."""
    request = f"timeout {REQUEST_TIMEOUT} {wget} -q -O - {shlex.quote(url)}"
    return f"i=0; while [ $i -lt {count} ]; do {request} || echo FAIL; i=$((i+1)); done"


def from_pod(lab: Lab, pod: str, url: str, count: int) -> Answers:
    """``count`` requests from inside ``pod`` (kubectl exec)."""
    proc = lab.kubectl(
        "exec", pod, "--", "/bin/sh", "-c", loop(url, count, "wget"), timeout=30 + 3 * count
    )
    return parse(proc.stdout, count)


def from_node(lab: Lab, node: str, url: str, count: int) -> Answers:
    """``count`` requests from ``node``'s network namespace (the host's busybox)."""
    script = loop(url, count, "busybox wget").replace("timeout ", "busybox timeout ", 1)
    proc = lab.exec(node, ["sh", "-c", script], timeout=30 + 3 * count)
    return parse(proc.stdout, count)


def items(lab: Lab, *args: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads(lab.kubectl("get", *args, "-o", "json").stdout)[
        "items"
    ]
    return found


def deploy(lab: Lab) -> None:
    """The backends and the Services, until every Service has its ready endpoints in an
    EndpointSlice (the controller-manager's endpointslice controller)."""
    pods = [*map(backend, NODES), backend(HOST_PORT_NODE, HOST_PORT_POD, HOST_PORT)]
    doc = {"apiVersion": "v1", "kind": "List", "items": [*pods, *SERVICES]}
    lab.kubectl("apply", "-f", "-", stdin=json.dumps(doc))
    want = {"web": 3, "web-n1": 1, "web-local": 1}

    def ready_endpoints() -> bool:
        slices = items(lab, "endpointslices")
        have: collections.Counter[str] = collections.Counter()
        for s in slices:
            name = s["metadata"].get("labels", {}).get("kubernetes.io/service-name", "")
            have[name] += sum(
                1 for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready")
            )
        return all(have[k] == v for k, v in want.items())

    wait_until(ready_endpoints, timeout=90, interval=0.5, what="every Service's endpoints ready")

    def host_port_ready() -> bool:
        (pod,) = items(lab, "pods", "-l", "app=hostport")
        return kubelet.pod_ready(pod)

    wait_until(host_port_ready, timeout=90, interval=0.5, what=f"{HOST_PORT_POD} ready")


@dataclass(frozen=True)
class Cluster:
    """What the checks need to know of the running cluster."""

    cluster_ips: dict[str, str]  # Service -> ClusterIP
    node_ports: dict[str, int]  # Service -> nodePort
    clients: dict[str, dict[str, str]]  # node -> {"name", "ip"} of its test pod
    backends: dict[str, str]  # backend pod -> its IP
    pod_cidrs: dict[str, IPv4Network]  # node -> podCIDR
    node_ips: dict[str, str]  # node -> underlay address


def cluster(lab: Lab) -> Cluster:
    services = {s["metadata"]["name"]: s for s in items(lab, "services")}
    clients = {
        p["spec"]["nodeName"]: {"name": p["metadata"]["name"], "ip": p["status"]["podIP"]}
        for p in items(lab, "pods", "-l", f"app={kubelet.WORKLOAD}")
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    }
    return Cluster(
        cluster_ips={n: s["spec"]["clusterIP"] for n, s in services.items()},
        node_ports={
            n: s["spec"]["ports"][0]["nodePort"]
            for n, s in services.items()
            if s["spec"]["type"] == "NodePort"
        },
        clients=clients,
        backends={
            p["metadata"]["name"]: p["status"]["podIP"] for p in items(lab, "pods", "-l", "app=web")
        },
        pod_cidrs={
            n["metadata"]["name"]: IPv4Network(n["spec"]["podCIDR"]) for n in items(lab, "nodes")
        },
        node_ips={n: str(lab.node(n).ip) for n in NODES},
    )


def gateway(c: Cluster, node: str) -> str:
    """The node's cni0 address: the first of its podCIDR."""
    return str(c.pod_cidrs[node].network_address + 1)


def in_pod_network(lab: Lab, address: str) -> bool:
    return IPv4Address(address) in IPv4Network(lab.state.network)


# A client pod's request loop that runs until told to stop: one line per request, as
# ``loop`` prints, into LOAD_OUT; the stop file ends it after the request in flight, and
# the done file says the output is whole.
LOAD_OUT, LOAD_STOP, LOAD_DONE = "/tmp/load.out", "/tmp/load.stop", "/tmp/load.done"
LOAD_GAP = 0.05  # seconds between two requests of one client


def load_loop(url: str) -> str:
    request = f"timeout {REQUEST_TIMEOUT} wget -q -O - {shlex.quote(url)}"
    return (
        f"rm -f {LOAD_OUT} {LOAD_STOP} {LOAD_DONE}; "
        f"while [ ! -e {LOAD_STOP} ]; do {request} || echo FAIL; sleep {LOAD_GAP}; done "
        f">{LOAD_OUT} 2>/dev/null; : >{LOAD_DONE}"
    )


@dataclass
class ServiceLoad:
    """Requests to ``url`` from each of ``pods``, back to back, for as long as the change
    under test takes: ``start()`` puts the loops in the background of the pods,
    ``stop()`` ends them and returns each pod's ``Answers`` (every line a request)."""

    lab: Lab
    pods: list[str]
    url: str

    def start(self) -> None:
        for pod in self.pods:
            script = f"sh -c {shlex.quote(load_loop(self.url))} </dev/null >/dev/null 2>&1 &"
            self.lab.kubectl("exec", pod, "--", "/bin/sh", "-c", script)
        for pod in self.pods:  # each loop has answered once before the change starts

            def answering(pod: str = pod) -> bool:
                out = self.lab.kubectl("exec", pod, "--", "cat", LOAD_OUT, check=False).stdout
                return bool(parse(out, 0).answered)

            wait_until(answering, timeout=30, interval=0.5, what=f"{pod}'s requests answered")

    def stop(self) -> dict[str, Answers]:
        for pod in self.pods:
            self.lab.kubectl("exec", pod, "--", "/bin/sh", "-c", f": >{LOAD_STOP}")
        found = {}
        for pod in self.pods:

            def done(pod: str = pod) -> bool:
                argv = ("exec", pod, "--", "/bin/sh", "-c", f"test -e {LOAD_DONE}")
                return self.lab.kubectl(*argv, check=False).returncode == 0

            wait_until(done, timeout=REQUEST_TIMEOUT + 20, interval=0.5, what=f"{pod}'s loop")
            out = self.lab.kubectl("exec", pod, "--", "cat", LOAD_OUT).stdout
            found[pod] = parse(out, len(out.splitlines()))
        return found
