"""The agent's CNI side: where a pod without a default route sends the cluster's traffic."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from ipaddress import IPv4Network
from pathlib import Path

import pytest

from flannelpy.cni.context import Deferred
from flannelpy.cni.pods import PodAttachments
from flannelpy.config.settings import AgentSettings
from flannelpy.observe.metrics import AgentMetrics


def test_the_cluster_network_is_the_configured_network(tmp_path: Path) -> None:
    settings = replace(
        AgentSettings(), state_dir=str(tmp_path / "state"), run_dir=str(tmp_path / "run")
    )
    network = IPv4Network("10.244.0.0/16")
    pods = PodAttachments(settings, lambda: 1450, lambda: True, AgentMetrics(), network)
    # Known from the start: no file to wait for, so such an ADD never has to retry.
    assert tuple(pods.handler.settings.cluster_networks()) == (network,)


class AnsweringHandler:
    """The handler's surface: answers every request with ``exit_code`` and ``out``."""

    def __init__(self, exit_code: int, out: bytes) -> None:
        self.exit_code, self.out = exit_code, out

    def handle(
        self,
        env: Mapping[str, str],
        stdin: bytes,
        netns_fd: int | None,
        defer: Deferred | None = None,
    ) -> tuple[int, bytes]:
        return self.exit_code, self.out


class DeferringHandler(AnsweringHandler):
    """Answers with success and leaves ``work`` for after the reply, as a DEL does."""

    def __init__(self, *work: Callable[[], None]) -> None:
        super().__init__(0, b"")
        self.work = work

    def handle(
        self,
        env: Mapping[str, str],
        stdin: bytes,
        netns_fd: int | None,
        defer: Deferred | None = None,
    ) -> tuple[int, bytes]:
        assert defer is not None
        defer.extend(self.work)
        return self.exit_code, self.out


def pod_side(tmp_path: Path) -> PodAttachments:
    settings = replace(
        AgentSettings(), state_dir=str(tmp_path / "state"), run_dir=str(tmp_path / "run")
    )
    return PodAttachments(
        settings, lambda: 1450, lambda: True, AgentMetrics(), IPv4Network("10.244.0.0/16")
    )


def test_listeners_hear_each_answered_request_and_none_can_fail_one(tmp_path: Path) -> None:
    pods = pod_side(tmp_path)
    heard: list[tuple[str, bytes, int | None, bytes]] = []

    def broken(env: Mapping[str, str], stdin: bytes, netns_fd: int | None, out: bytes) -> None:
        raise RuntimeError("a listener's own bug")

    pods.add_listener(broken)
    pods.add_listener(
        lambda env, stdin, fd, out: heard.append((env["CNI_COMMAND"], stdin, fd, out))
    )
    pods.handler = AnsweringHandler(0, b'{"ips": []}')  # type: ignore[assignment]
    assert pods._handle({"CNI_COMMAND": "ADD"}, b"config", 7) == (0, b'{"ips": []}')
    assert heard == []  # not before the answer is sent: the server tells them after
    assert pods.server.after_reply is not None
    pods.server.after_reply({"CNI_COMMAND": "ADD"}, b"config", 7, 0, b'{"ips": []}')
    assert heard == [("ADD", b"config", 7, b'{"ips": []}')]  # told, though one raised
    # A request answered with an error attached nothing: no listener hears of it.
    error = b'{"cniVersion": "1.0.0", "code": 11, "msg": "try again later"}'
    pods.handler = AnsweringHandler(1, error)  # type: ignore[assignment]
    assert pods._handle({"CNI_COMMAND": "ADD"}, b"config", 8) == (1, error)
    pods.server.after_reply({"CNI_COMMAND": "ADD"}, b"config", 8, 1, error)
    assert heard == [("ADD", b"config", 7, b'{"ips": []}')]


def test_what_a_request_defers_runs_after_the_reply_and_a_failure_only_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pods = pod_side(tmp_path)
    ran: list[str] = []
    heard: list[str] = []

    def broken() -> None:
        ran.append("broken")
        raise OSError(28, "No space left on device")

    pods.add_listener(lambda env, stdin, fd, out: heard.append(env["CNI_COMMAND"]))
    pods.handler = DeferringHandler(broken, lambda: ran.append("second"))  # type: ignore[assignment]
    assert pods._handle({"CNI_COMMAND": "DEL"}, b"config", None) == (0, b"")
    assert ran == []  # the reply goes first
    assert pods.server.after_reply is not None
    pods.server.after_reply({"CNI_COMMAND": "DEL"}, b"config", None, 0, b"")
    assert ran == ["broken", "second"] and heard == ["DEL"]
    assert "the address stays assigned until a GC releases it" in caplog.text
    # Run once: the next request on this thread finds nothing left over.
    pods.handler = AnsweringHandler(0, b"")  # type: ignore[assignment]
    pods._handle({"CNI_COMMAND": "DEL"}, b"config", None)
    pods.server.after_reply({"CNI_COMMAND": "DEL"}, b"config", None, 0, b"")
    assert ran == ["broken", "second"]


def test_what_a_request_deferred_runs_at_once_when_its_handling_fails(tmp_path: Path) -> None:
    pods = pod_side(tmp_path)
    ran: list[str] = []
    pods.handler = DeferringHandler(lambda: ran.append("release"))  # type: ignore[assignment]

    def failing_metrics(*args: object) -> None:
        raise RuntimeError("a metrics bug")

    pods._metrics.cni_request = failing_metrics  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        pods._handle({"CNI_COMMAND": "DEL"}, b"config", None)
    assert ran == ["release"]  # the server sends no reply to wait for
