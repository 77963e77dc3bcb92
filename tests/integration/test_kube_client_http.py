"""Our Kubernetes client over real HTTP, against a small server that records what it is
sent: list and watch query parameters, patch content types, watch lines however the
chunks cut them, a rotated token picked up after a 401, one connection reused across
requests, and the failures (unreachable, 410 on a watch) as our errors."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest

from flannelpy.errors import RevisionCompacted, StoreError, StoreUnavailable
from flannelpy.store.kube.api import NotFound
from flannelpy.store.kube.client import MERGE_PATCH, KubeClient, path
from flannelpy.store.kube.kubeconfig import Access
from tests.integration.test_policy_watch_http import serving

# A watch's bytes as the server cuts them into chunks: a line split across two chunks,
# two lines in one, a blank keep-alive line.
WATCH_CHUNKS = [
    b'{"type": "ADDED", "object": {"metadata": {"name": "a"}}}\n{"type": "MOD',
    b'IFIED", "object": {"metadata": {"name": "a", "resourceVersion": "9"}}}\n\n',
    b'{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "10"}}}\n'
    b'{"type": "DELETED", "object": {"metadata": {"name": "a"}}}\n',
]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[dict[str, Any]]] = []
    ports: ClassVar[set[int]] = set()
    valid_token: ClassVar[str] = "tok-2"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, doc: Any) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.seen.append(
            {
                "method": self.command,
                "path": url.path,
                "query": parse_qs(url.query),
                "auth": self.headers.get("Authorization"),
                "type": self.headers.get("Content-Type"),
                "body": json.loads(body) if body else None,
            }
        )
        self.ports.add(self.client_address[1])
        if self.headers.get("Authorization") not in (None, f"Bearer {self.valid_token}"):
            self._reply(401, {"kind": "Status", "code": 401, "message": "Unauthorized"})
        elif url.path == "/api/v1/nodes" and parse_qs(url.query).get("watch") == ["true"]:
            if parse_qs(url.query).get("resourceVersion") == ["1"]:
                self._reply(410, {"kind": "Status", "code": 410, "message": "too old"})
                return
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in WATCH_CHUNKS:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        elif url.path == "/api/v1/nodes/gone":
            self._reply(404, {"kind": "Status", "code": 404, "message": 'nodes "gone" not found'})
        elif url.path == "/prefix/api/v1/nodes/n1" or url.path == "/api/v1/nodes/n1":
            self._reply(200, {"metadata": {"name": "n1"}, "echo": self.seen[-1]["body"]})
        else:
            self._reply(200, {"metadata": {"resourceVersion": "7"}, "items": []})

    do_GET = do_PATCH = do_POST = _handle


@pytest.fixture
def server() -> Iterator[str]:
    Handler.seen.clear()
    Handler.ports.clear()
    with serving(Handler) as url:
        yield url


def test_list_query_patch_and_one_pooled_connection(server: str) -> None:
    client = KubeClient(Access(server=server + "/"))
    try:
        page = client.get(
            "list leases",
            path("apis/coordination.k8s.io/v1/namespaces", "kube-flannelpy", "leases"),
            {"labelSelector": "flannelpy.io/node-status=true", "limit": 500, "continue": None},
        )
        assert page["metadata"]["resourceVersion"] == "7"
        written = client.send(
            "patch node n1", "PATCH", path("api/v1/nodes", "n1"), {"a": 1}, MERGE_PATCH
        )
        assert written["echo"] == {"a": 1}
    finally:
        client.close()
    listed, patched = Handler.seen
    assert listed["path"] == "/apis/coordination.k8s.io/v1/namespaces/kube-flannelpy/leases"
    assert listed["query"] == {"labelSelector": ["flannelpy.io/node-status=true"], "limit": ["500"]}
    assert listed["auth"] is None  # --kube-api-url alone: no credentials
    assert (patched["method"], patched["type"]) == ("PATCH", MERGE_PATCH)
    assert len(Handler.ports) == 1  # the second request reused the first one's connection


def test_a_server_url_with_a_path_keeps_it(server: str) -> None:
    client = KubeClient(Access(server=server + "/prefix"))
    try:
        assert client.get("get node n1", path("api/v1/nodes", "n1"))["metadata"]["name"] == "n1"
    finally:
        client.close()
    assert Handler.seen[0]["path"] == "/prefix/api/v1/nodes/n1"


def test_watch_lines_whatever_the_chunks_and_its_query(server: str) -> None:
    client = KubeClient(Access(server=server))
    try:
        stream = client.watch(
            "watch nodes",
            "/api/v1/nodes",
            {"resourceVersion": "5", "allowWatchBookmarks": True, "timeoutSeconds": 300},
            timeout=(5.0, 30.0),
        )
        try:
            events = [json.loads(line) for line in stream.lines() if line.strip()]
        finally:
            stream.close()
        with pytest.raises(RevisionCompacted, match=r"watch nodes: too old \(410 Gone\)"):
            client.watch("watch nodes", "/api/v1/nodes", {"resourceVersion": "1"}, (5.0, 5.0))
    finally:
        client.close()
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "BOOKMARK", "DELETED"]
    assert events[1]["object"]["metadata"]["resourceVersion"] == "9"
    query = Handler.seen[0]["query"]
    assert query == {
        "resourceVersion": ["5"],
        "allowWatchBookmarks": ["true"],
        "timeoutSeconds": ["300"],
        "watch": ["true"],
    }


def test_a_rotated_token_is_read_again_after_a_401(server: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("tok-1")  # already expired on the server
    client = KubeClient(Access(server=server, token_file=str(token)))
    try:
        with pytest.raises(StoreError, match=r"unauthorized \(Unauthorized\); check the Service"):
            client.get("get node n1", "/api/v1/nodes/n1")
        token.write_text("tok-2")  # the kubelet rotated it: the next 401 reads it at once
        assert client.get("get node n1", "/api/v1/nodes/n1")["metadata"]["name"] == "n1"
    finally:
        client.close()
    assert [r["auth"] for r in Handler.seen] == [
        "Bearer tok-1",
        "Bearer tok-1",  # read again after the 401, unchanged: one retry, then the error
        "Bearer tok-1",  # still within the minute: the cached token, refused
        "Bearer tok-2",  # read again after that 401: accepted
    ]


def test_not_found_and_unreachable(server: str) -> None:
    client = KubeClient(Access(server=server))
    try:
        with pytest.raises(NotFound, match=r'get node gone: not found \(nodes "gone" not found\)'):
            client.get("get node gone", "/api/v1/nodes/gone")
    finally:
        client.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    closed = KubeClient(Access(server=f"http://127.0.0.1:{port}"))
    with pytest.raises(StoreUnavailable, match=r"cannot reach the API server .*; check --kube-api"):
        closed.get("list nodes", "/api/v1/nodes")
