"""NetworkPolicy's inputs in Kubernetes mode: each kind listed, then watched from the
list's resourceVersion; 410 Gone lists again and the new list replaces the old; an
object the compiler cannot represent is refused once and never ends the watch. And the
flag that turns it on, refused in etcd mode."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from flannelpy.cli import build_parser
from flannelpy.config.settings import settings_from_args
from flannelpy.errors import ConfigError, StoreUnavailable
from flannelpy.store.kube.kind_watch import KindWatch, Resource
from flannelpy.store.policy_inputs import NAMESPACES, PODS, POLICIES, PolicyCache


def ns(name: str, rv: str = "1", **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": rv, "labels": labels}}


class FakeApi:
    """Pages to list and watch streams to open, in order; records each watch's rv."""

    def __init__(self, pages: list[list[dict[str, Any]]], streams: list[list[Any]]) -> None:
        self.pages = pages
        self.streams = streams
        self.watched_from: list[str] = []
        self.lists = 0
        self.stop = threading.Event()

    def list_page(self, token: str | None) -> dict[str, Any]:
        page = self.pages.pop(0)
        self.lists += 1
        more = {"continue": "next"} if self.pages and token is None and len(page) == 1 else {}
        return {"metadata": {"resourceVersion": f"{10 * self.lists}", **more}, "items": page}

    def open_watch(self, rv: str, stop: threading.Event) -> Iterator[Any]:
        self.watched_from.append(rv)
        if not self.streams:
            self.stop.set()
            return
        stream = self.streams.pop(0)
        for event in stream:
            if isinstance(event, Exception):
                raise event
            yield event


def run(api: FakeApi, cache: PolicyCache, kind: str = NAMESPACES) -> list[int]:
    changes: list[int] = []
    watch = KindWatch(
        Resource(kind, api.list_page, api.open_watch),
        cache,
        lambda: changes.append(1),
        sleep=lambda stop, seconds: None,
    )
    watch.run(api.stop)
    return changes


def test_list_then_watch_from_its_resource_version_then_relist_on_gone() -> None:
    cache = PolicyCache()
    api = FakeApi(
        pages=[[ns("a", team="x")], [ns("b")], [ns("c")]],
        streams=[
            [
                {"type": "ADDED", "object": ns("d", "11")},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}},
                {"type": "MODIFIED", "object": ns("a", "16", team="y")},
                {"type": "DELETED", "object": ns("b", "17")},
                {"type": "ERROR", "object": {"code": 410, "message": "too old"}},
            ],
            [StoreUnavailable("the connection broke")],
        ],
    )
    changes = run(api, cache)
    # two pages of one list (rv 10), watched from it; after 410 one new list, from its rv;
    # after the broken connection the watch resumes from the same rv without a list
    assert api.watched_from == ["10", "30", "30"]
    assert [n.name for n in cache.snapshot().namespaces] == ["c"]  # the new list is all
    assert len(changes) == 5  # list, ADDED, MODIFIED, DELETED, list


def test_invalid_objects_are_refused_once_counted_and_the_watch_goes_on() -> None:
    refused: list[str] = []
    cache = PolicyCache(refused.append)
    bad = {"metadata": {"namespace": "shop", "name": "p"}, "spec": {"podSelector": {},
           "ingress": [{"from": [{"ipBlock": {"cidr": "nonsense"}}]}]}}  # fmt: skip
    api = FakeApi(
        pages=[[bad]],
        streams=[[{"type": "MODIFIED", "object": bad}, "not an event", {"type": "ADDED"}]],
    )
    run(api, cache, POLICIES)
    assert refused == ["networkpolicy"]
    assert cache.snapshot().policies == ()
    assert cache.snapshot().refused == (
        "NetworkPolicy shop/p is refused: spec.ingress[0].from[0].ipBlock.cidr 'nonsense' is "
        "not a CIDR",
    )


def test_a_refused_edit_and_its_repair_each_make_a_new_snapshot_due() -> None:
    """The snapshot carries the refusals the agent reports: an edit refused, and the
    same object accepted again with the version already enforced, both change it."""
    cache = PolicyCache()
    good = {"metadata": {"namespace": "shop", "name": "p"}, "spec": {"podSelector": {}}}
    bad = {"metadata": {"namespace": "shop", "name": "p"},
           "spec": {"podSelector": {}, "policyTypes": ["Sideways"]}}  # fmt: skip
    assert cache.put(POLICIES, good)
    assert cache.put(POLICIES, bad)  # refused: the enforced version stays, the report changes
    assert [p.name for p in cache.snapshot().policies] == ["p"]
    assert len(cache.snapshot().refused) == 1
    assert not cache.put(POLICIES, bad)  # the same refusal again: nothing new
    assert cache.put(POLICIES, good)  # accepted, unchanged from the enforced: refusal gone
    assert cache.snapshot().refused == ()
    assert not cache.put(POLICIES, good)
    assert cache.put(POLICIES, bad)
    assert cache.delete(POLICIES, bad) and cache.snapshot().refused == ()


def test_synced_only_once_every_kind_is_listed_and_pods_without_an_address_are_not_kept() -> None:
    cache = PolicyCache()
    cache.replace_all(POLICIES, [])
    cache.replace_all(NAMESPACES, [ns("shop")])
    assert not cache.snapshot().synced
    pending = {"metadata": {"namespace": "shop", "name": "p"}, "spec": {}, "status": {}}
    cache.replace_all(PODS, [pending])
    assert cache.snapshot().synced and cache.snapshot().pods == ()


def agent_flags(argv: list[str], env: dict[str, str] | None = None) -> Any:
    return settings_from_args(build_parser().parse_args(["agent", *argv]), env or {})


def test_the_flag_is_off_by_default_and_needs_kubernetes_mode() -> None:
    assert agent_flags([]).enable_network_policy is False
    on = agent_flags(["--kube-subnet-mgr"], {"FLANNELD_ENABLE_NETWORK_POLICY": "true"})
    assert on.enable_network_policy is True
    with pytest.raises(ConfigError) as e:
        agent_flags(["--enable-network-policy"])
    assert str(e.value) == (
        "--enable-network-policy needs Kubernetes mode, since etcd mode has no Pods or "
        "NetworkPolicies; add --kube-subnet-mgr or remove it"
    )
