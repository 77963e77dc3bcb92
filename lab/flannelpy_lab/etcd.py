"""The lab's etcd: one member in the host namespace, on the host's lab address.

Listening only on the lab address keeps it off the machine's other interfaces
and lets several labs run side by side (each has its own address). Clients
here disable gRPC's HTTP proxy support: a proxy from the environment would
carry lab traffic out of the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from ipaddress import IPv4Network
from typing import Any
from urllib.parse import urlsplit

import pyetcd

from flannelpy.subnet.keys import key_to_subnet
from flannelpy.subnet.lease import LeaseAttrs
from flannelpy_lab import procs
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState

START_TIMEOUT = 20.0  # seconds for etcd to answer after start
RPC_TIMEOUT = 2.0  # seconds per request
GRPC_OPTIONS = [("grpc.enable_http_proxy", 0)]


def etcd_argv(state: LabState) -> list[str]:
    binary = shutil.which("etcd")
    if binary is None:
        raise LabError("etcd is not on PATH; install an etcd server (3.4 or newer)")
    host = urlsplit(state.etcd_endpoint).hostname
    peer = f"http://{host}:2380"
    return [
        binary,
        "--name", f"fpl-{state.name}",
        "--data-dir", state.etcd_data_dir,
        "--listen-client-urls", state.etcd_endpoint,
        "--advertise-client-urls", state.etcd_endpoint,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"fpl-{state.name}={peer}",
        "--initial-cluster-state", "new",
        "--logger", "zap",
        "--log-outputs", "stderr",
        "--log-level", "warn",
    ]  # fmt: skip


def start(state: LabState) -> procs.ProcessRef:
    os.makedirs(state.lab_dir, exist_ok=True)
    return procs.spawn_detached(etcd_argv(state), state.etcd_log)


@contextmanager
def client(endpoint: str, timeout: float = RPC_TIMEOUT) -> Iterator[Any]:
    url = urlsplit(endpoint)
    c = pyetcd.client(
        host=url.hostname, port=url.port or 2379, timeout=timeout, grpc_options=GRPC_OPTIONS
    )
    try:
        yield c
    finally:
        c.close()


def wait_answering(state: LabState, ref: procs.ProcessRef, timeout: float = START_TIMEOUT) -> None:
    """Return once etcd serves a read; fail early, with its log, if it exits."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not procs.alive(ref):
            raise LabError(
                f"etcd exited during start; last lines of {state.etcd_log}:\n"
                + procs.log_tail(state.etcd_log)
            )
        # A fresh client per try: pyetcd shuns an endpoint for minutes after one failure.
        try:
            with client(state.etcd_endpoint, timeout=1.0) as c:
                c.get(f"{state.etcd_prefix}/config")
            return
        except Exception as e:  # pyetcd raises several unrelated types while starting
            last = e
            time.sleep(0.2)
    raise LabError(
        f"etcd at {state.etcd_endpoint} did not answer within {timeout:g} s ({last}); "
        f"see {state.etcd_log}"
    )


def put_config(state: LabState, config_json: str) -> None:
    with client(state.etcd_endpoint) as c:
        c.put(f"{state.etcd_prefix}/config", config_json)


def read_leases(endpoint: str, prefix: str) -> list[dict[str, Any]]:
    """Every lease under ``<prefix>/subnets/`` as a JSON-ready dict, sorted by subnet."""
    subnets_prefix = f"{prefix.rstrip('/')}/subnets/"
    leases = []
    with client(endpoint) as c:
        for value, meta in c.get_prefix(subnets_prefix):
            key = meta.key.decode()[len(subnets_prefix) :]
            leases.append(_lease_doc(key, value))
    return sorted(leases, key=_sort_key)


def _lease_doc(key: str, value: bytes) -> dict[str, Any]:
    doc: dict[str, Any] = dict.fromkeys(("subnet", "public_ip", "backend", "node_name", "error"))
    doc["key"] = key
    try:
        subnet, _ = key_to_subnet(key)
        attrs = LeaseAttrs.from_json(value)
    except ValueError as e:
        doc["error"] = str(e)
        return doc
    doc.update(
        subnet=str(subnet),
        public_ip=str(attrs.public_ip),
        backend=attrs.backend_type,
        node_name=attrs.node_name,
        backend_data=json.loads(json.dumps(attrs.backend_data)) if attrs.backend_data else None,
    )
    return doc


def _sort_key(doc: dict[str, Any]) -> tuple[int, int, str]:
    subnet = doc["subnet"]
    if subnet is None:
        return (1, 0, doc["key"])
    return (0, int(IPv4Network(subnet).network_address), doc["key"])
