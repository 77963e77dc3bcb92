"""A peer's records kept compact: the prober's window as a tuple and the plan's address,
lease values sharing their keys and MAC, the memo's leases in a list, overlap checks that
cache nothing on the networks."""

from __future__ import annotations

import json
from ipaddress import IPv4Address, IPv4Network, IPv6Network, ip_network

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.subnet import span
from flannelpy.subnet.lease import LeaseAttrs
from flannelpy.subnet.memo import LeaseMemo
from tests.support.fakes import lease
from tests.unit.test_prober import make, rounds

# --- the prober's window ----------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(window=st.integers(1, 5), lost=st.lists(st.booleans(), min_size=1, max_size=12))
def test_the_window_holds_the_last_rounds(window: int, lost: list[bool]) -> None:
    prober, net, clock, _ = make(window=window)
    net.drop_small = lambda target, n: lost[(n - 1) % len(lost)]
    result = rounds(prober, clock, len(lost))
    kept = lost[-window:]
    assert result.loss_ratio == pytest.approx(sum(kept) / len(kept))
    assert result.probes == len(lost)


def test_the_prober_shares_the_plans_address() -> None:
    prober, _, _, _ = make()
    target = IPv4Address("10.244.9.1")
    prober.set_peers({"p9": (target, "node9")})
    assert prober._peers["p9"].target is target


# --- lease values ------------------------------------------------------------------------

macs = st.lists(st.integers(0, 255), min_size=6, max_size=6).map(
    lambda octets: ":".join(f"{o:02x}" for o in octets)
)


@settings(max_examples=50)
@given(mac=macs, upper=st.booleans(), vni=st.integers(1, 2**24 - 1), name=st.text(max_size=20))
def test_a_compact_lease_value_round_trips(mac: str, upper: bool, vni: int, name: str) -> None:
    written = mac.upper() if upper else mac
    attrs = LeaseAttrs(
        public_ip=IPv4Address("192.168.1.20"),
        backend_type="vxlan",
        backend_data={"VNI": vni, "VtepMAC": written},
        node_name=name,
    )
    parsed = LeaseAttrs.from_json(attrs.to_json())
    assert parsed == attrs
    assert json.loads(parsed.to_json()) == json.loads(attrs.to_json())
    assert parsed.vtep_mac == mac
    assert parsed.backend_data is not None
    if not upper:  # lower case, as Flannel writes it: the lease's own string
        assert parsed.vtep_mac is parsed.backend_data["VtepMAC"]


def test_leases_share_their_keys_and_backend_type() -> None:
    values = [
        json.dumps(
            {
                "PublicIP": f"192.168.1.{i}",
                "BackendType": "vxlan",
                "BackendData": {"VNI": 1, "VtepMAC": f"02:00:00:00:00:{i:02x}"},
            }
        )
        for i in (1, 2)
    ]
    a, b = (LeaseAttrs.from_json(v) for v in values)
    assert a.backend_type is b.backend_type
    assert a.backend_data is not None and b.backend_data is not None
    for key_a, key_b in zip(a.backend_data, b.backend_data, strict=True):
        assert key_a is key_b


# --- the memo ----------------------------------------------------------------------------


def test_the_memo_computes_a_lease_passed_twice_once() -> None:
    memo: LeaseMemo[str] = LeaseMemo()
    one, two = lease("10.100.0.0/24", "172.16.0.1"), lease("10.100.1.0/24", "172.16.0.2")
    computed: list[object] = []

    def compute(x):  # type: ignore[no-untyped-def]
        computed.append(x)
        return str(x.subnet)

    delta = memo.update(None, [one, two, one], compute)
    assert delta.results == ["10.100.0.0/24", "10.100.1.0/24", "10.100.0.0/24"]
    assert computed == [one, two] and len(delta.added) == 2
    assert memo.update(None, [two], compute).dropped == ["10.100.0.0/24"]
    assert computed == [one, two]


# --- overlap without the cached properties -------------------------------------------------


def networks(version: int) -> st.SearchStrategy[IPv4Network | IPv6Network]:
    bits, kind = (32, IPv4Network) if version == 4 else (128, IPv6Network)
    return st.tuples(st.integers(0, 2**bits - 1), st.integers(0, bits)).map(
        lambda t: kind((t[0], t[1]), strict=False)
    )


@settings(max_examples=300)
@given(data=st.data(), version=st.sampled_from([4, 6]))
def test_span_checks_agree_with_ipaddress(data: st.DataObject, version: int) -> None:
    a, b = data.draw(networks(version)), data.draw(networks(version))
    fresh_a, fresh_b = ip_network(str(a)), ip_network(str(b))
    assert span.overlaps(fresh_a, fresh_b) == a.overlaps(b)  # type: ignore[arg-type]
    assert span.within(fresh_a, fresh_b) == a.subnet_of(b)  # type: ignore[arg-type]
    assert span.span(fresh_a) == (int(a.network_address), int(a.broadcast_address))
    # and nothing was cached on the networks looked at
    for net in (fresh_a, fresh_b):
        assert "broadcast_address" not in vars(net) and "hostmask" not in vars(net)


def test_span_checks_never_match_across_families() -> None:
    v4, v6 = IPv4Network("0.0.0.0/0"), IPv6Network("::/0")
    assert not span.overlaps(v4, v6) and not span.within(v4, v6)
