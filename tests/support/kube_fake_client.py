"""A KubeClient whose requests a test answers in process: the real client's decoding and
error mapping (404 → NotFound, 409 → Conflict, 403 → Forbidden, ...) over a handler that
returns ``(status, doc)``. Subclasses implement :meth:`FakeApi.handle`."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from flannelpy.store.kube.client import Answer, KubeClient
from flannelpy.store.kube.kubeconfig import Access

Json = dict[str, Any]


class FakeApi(KubeClient):
    def __init__(self) -> None:
        super().__init__(Access(server="http://api.invalid"))
        self.calls: list[tuple[str, str]] = []  # (method, path)

    def handle(
        self, method: str, path: str, query: dict[str, str], body: Any, content_type: str | None
    ) -> tuple[int, Any]:
        raise NotImplementedError

    def _answer(
        self,
        what: str,
        method: str,
        url: str,
        body: bytes | None = None,
        content_type: str | None = None,
        timeout: tuple[float, float] = (5.0, 15.0),
    ) -> Answer:
        parts = urlsplit(url)
        self.calls.append((method, parts.path))
        doc = json.loads(body) if body is not None else None
        status, answer = self.handle(
            method, parts.path, dict(parse_qsl(parts.query)), doc, content_type
        )
        if status >= 300 and not isinstance(answer, dict):
            answer = {"kind": "Status", "code": status, "message": str(answer or "fake")}
        return Answer(status, "fake", json.dumps(answer).encode())
