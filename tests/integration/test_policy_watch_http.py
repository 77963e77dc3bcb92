"""The policy watches over our Kubernetes client against a small HTTP server: the
three kinds listed from every namespace's path, then watched from the list's
resourceVersion with bookmarks, their events in the snapshot, and a stop that ends a
watch blocked on an open stream."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest

from flannelpy.store.kube.client import KubeClient
from flannelpy.store.kube.kubeconfig import Access
from flannelpy.store.kube.policy_watch import KubePolicySource, kube_resources
from tests.support.waiting import wait_until

PATHS = {
    "/apis/networking.k8s.io/v1/networkpolicies": {
        "metadata": {"namespace": "shop", "name": "deny"},
        "spec": {"podSelector": {}},
    },
    "/api/v1/namespaces": {"metadata": {"name": "shop"}},
    "/api/v1/pods": {
        "metadata": {"namespace": "shop", "name": "a"},
        "spec": {"nodeName": "n1"},
        "status": {"podIP": "10.244.1.2"},
    },
}
WATCHED = {
    "metadata": {"namespace": "shop", "name": "b", "resourceVersion": "8"},
    "spec": {"nodeName": "n1"},
    "status": {"podIP": "10.244.1.3"},
}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[tuple[str, dict[str, list[str]]]]] = []

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        self.seen.append((url.path, query))
        if url.path not in PATHS:
            self.send_error(404)
            return
        if query.get("watch") != ["true"]:
            body = json.dumps({"metadata": {"resourceVersion": "7"}, "items": [PATHS[url.path]]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if url.path == "/api/v1/pods":
            line = json.dumps({"type": "ADDED", "object": WATCHED}).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
        threading.Event().wait(30)  # an open stream with nothing more to say


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` on a loopback port, in a thread; yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def api() -> Iterator[str]:
    with serving(Handler) as url:
        yield url


def test_every_kind_is_listed_then_watched_and_stop_ends_an_open_watch(api: str) -> None:
    client = KubeClient(Access(server=api))
    source = KubePolicySource(kube_resources(client))
    stop = threading.Event()
    changes: list[int] = []
    thread = threading.Thread(target=source.watch, args=(lambda: changes.append(1), stop))
    thread.start()
    try:
        snap = wait_until(
            lambda: (s := source.snapshot()).synced and len(s.pods) == 2 and s, 10.0, "sync"
        )
        assert [p.key for p in snap.policies] == ["shop/deny"]
        assert sorted(p.key for p in snap.pods) == ["shop/a", "shop/b"]
        watches = {p: q for p, q in Handler.seen if q.get("watch") == ["true"]}
        assert set(watches) == set(PATHS)
        assert all(q["resourceVersion"] == ["7"] for q in watches.values())
        assert all(q["allowWatchBookmarks"] == ["true"] for q in watches.values())
    finally:
        stop.set()
        thread.join(10.0)
        client.close()
    assert not thread.is_alive()
    assert len(changes) >= 4  # three lists and the watched pod
