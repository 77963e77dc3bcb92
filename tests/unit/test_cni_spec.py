"""flannelpy/cni/spec.py: the validation table, results per version, error JSON."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.cni import spec
from flannelpy.cni.spec import (
    CniError,
    Code,
    Interface,
    IPConfig,
    Result,
    RouteEntry,
    parse_request,
    parse_result,
    render_result,
)

ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "0f3c9e2a1b",
    "CNI_NETNS": "/var/run/netns/pod1",
    "CNI_IFNAME": "eth0",
    "CNI_PATH": "/opt/cni/bin:/usr/lib/cni",
}
CONFIG: dict[str, Any] = {"cniVersion": "1.0.0", "name": "flannelpy", "type": "flannelpy-cni"}
DROP = object()  # marks a key to remove from ENV or CONFIG


def request(config: dict[str, Any] | None = None) -> bytes:
    return json.dumps(_merge(CONFIG, config or {})).encode()


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        if value is DROP:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


# (id, env changes, config changes or raw stdin bytes, expected code)
ERROR_TABLE: list[tuple[str, dict[str, Any], dict[str, Any] | bytes, int]] = [
    ("malformed-json", {}, b'{"cniVersion": ', 6),
    ("empty-stdin", {}, b"", 6),
    ("not-utf8", {}, b'{"name": "\xff"}', 6),
    ("trailing-garbage", {}, b'{"cniVersion": "1.0.0"} x', 6),
    ("stdin-array", {}, b"[1, 2]", 6),  # skel: its decoder cannot read a non-object
    ("stdin-string", {}, b'"config"', 6),
    ("no-cniVersion", {}, {"cniVersion": DROP}, 7),
    ("no-name", {}, {"name": DROP}, 7),
    ("no-type", {}, {"type": DROP}, 7),
    ("cniVersion-not-string", {}, {"cniVersion": 1.0}, 7),
    ("empty-name", {}, {"name": ""}, 7),
    ("empty-type", {}, {"type": ""}, 7),
    ("old-cniVersion", {}, {"cniVersion": "0.2.0"}, 1),
    ("future-cniVersion", {}, {"cniVersion": "2.0.0"}, 1),
    ("no-command", {"CNI_COMMAND": DROP}, {}, 4),
    ("empty-command", {"CNI_COMMAND": ""}, {}, 4),
    ("unknown-command", {"CNI_COMMAND": "FOO"}, {}, 4),
    ("lowercase-command", {"CNI_COMMAND": "add"}, {}, 4),
    *[
        (f"{cmd}-without-{var}", {"CNI_COMMAND": cmd, var: DROP}, {"cniVersion": "1.1.0"}, 4)
        for cmd, variables in spec.REQUIRED_ENV.items()
        for var in variables
    ],
    ("ADD-empty-netns", {"CNI_NETNS": ""}, {}, 4),
    ("ifname-16-bytes", {"CNI_IFNAME": "a" * 16}, {}, 4),
    ("ifname-16-utf8-bytes", {"CNI_IFNAME": "é" * 8}, {}, 4),
    ("ifname-slash", {"CNI_IFNAME": "eth/0"}, {}, 4),
    ("ifname-colon", {"CNI_IFNAME": "eth:0"}, {}, 4),
    ("ifname-space", {"CNI_IFNAME": "eth 0"}, {}, 4),
    ("ifname-tab", {"CNI_IFNAME": "eth\t0"}, {}, 4),
    ("ifname-dot", {"CNI_IFNAME": "."}, {}, 4),
    ("ifname-dotdot", {"CNI_IFNAME": ".."}, {}, 4),
    ("containerid-escape", {"CNI_CONTAINERID": "../../etc"}, {}, 4),
    ("containerid-slash", {"CNI_CONTAINERID": "a/b"}, {}, 4),
    ("containerid-leading-dot", {"CNI_CONTAINERID": ".hidden"}, {}, 4),
    ("containerid-leading-dash", {"CNI_CONTAINERID": "-x"}, {}, 4),
    ("containerid-too-long", {"CNI_CONTAINERID": "a" * 201}, {}, 4),
    ("containerid-newline", {"CNI_CONTAINERID": "abc\n"}, {}, 4),
    ("containerid-space", {"CNI_CONTAINERID": "a b"}, {}, 4),
    ("name-escape", {}, {"name": "../net"}, 7),
    ("name-slash", {}, {"name": "a/b"}, 7),
    ("name-dot", {}, {"name": "."}, 7),
    ("name-dotdot", {}, {"name": ".."}, 7),
    ("name-leading-dash", {}, {"name": "-net"}, 7),
    ("name-not-string", {}, {"name": ["net"]}, 7),
    ("args-no-equals", {"CNI_ARGS": "FOO"}, {}, 4),
    ("args-trailing-semicolon", {"CNI_ARGS": "A=B;"}, {}, 4),
    ("args-empty-key", {"CNI_ARGS": "=B"}, {}, 4),
    ("args-two-equals", {"CNI_ARGS": "A=B=C"}, {}, 4),
    ("CHECK-before-0.4.0", {"CNI_COMMAND": "CHECK"}, {"cniVersion": "0.3.1"}, 1),
    ("GC-before-1.1.0", {"CNI_COMMAND": "GC"}, {"cniVersion": "1.0.0"}, 1),
    ("STATUS-before-1.1.0", {"CNI_COMMAND": "STATUS"}, {"cniVersion": "0.4.0"}, 1),
    ("prevResult-not-object", {}, {"prevResult": [1]}, 7),
    ("runtimeConfig-not-object", {}, {"runtimeConfig": "x"}, 7),
]


@pytest.mark.parametrize(
    ("env_changes", "stdin", "code"),
    [pytest.param(e, s, c, id=i) for i, e, s, c in ERROR_TABLE],
)
def test_validation_table(env_changes: dict[str, Any], stdin: Any, code: int) -> None:
    env = _merge(ENV, env_changes)
    data = stdin if isinstance(stdin, bytes) else request(config=stdin)
    with pytest.raises(CniError) as info:
        parse_request(env, data)
    assert info.value.code == code, info.value.msg
    assert "\n" not in info.value.msg  # one sentence, no traceback
    assert info.value.msg.rstrip()


# (id, env changes, config changes) that must pass
OK_TABLE: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("ADD", {}, {}),
    ("DEL-without-netns", {"CNI_COMMAND": "DEL", "CNI_NETNS": DROP}, {}),
    ("CHECK-at-0.4.0", {"CNI_COMMAND": "CHECK"}, {"cniVersion": "0.4.0"}),
    ("GC-at-1.1.0", {"CNI_COMMAND": "GC", "CNI_CONTAINERID": DROP}, {"cniVersion": "1.1.0"}),
    ("STATUS-only-path", {"CNI_COMMAND": "STATUS", "CNI_IFNAME": DROP}, {"cniVersion": "1.1.0"}),
    ("ifname-15-bytes", {"CNI_IFNAME": "a" * 15}, {}),
    ("ifname-14-utf8-bytes", {"CNI_IFNAME": "é" * 7}, {}),
    ("containerid-all-classes", {"CNI_CONTAINERID": "A1_.-b"}, {}),
    ("name-all-classes", {}, {"name": "net_1.a-b"}),
    ("args-empty-value", {"CNI_ARGS": "A=B;C="}, {}),
    ("every-version", {}, {"cniVersion": "0.3.0"}),
]


@pytest.mark.parametrize(
    ("env_changes", "config_changes"), [pytest.param(e, c, id=i) for i, e, c in OK_TABLE]
)
def test_valid_requests_pass(env_changes: dict[str, Any], config_changes: dict[str, Any]) -> None:
    env = _merge(ENV, env_changes)
    req = parse_request(env, request(config=config_changes))
    assert req.command == env["CNI_COMMAND"]
    assert req.container_id == env.get("CNI_CONTAINERID", "")
    assert req.netns == env.get("CNI_NETNS", "")
    assert req.cni_version == _merge(CONFIG, config_changes)["cniVersion"]


def test_request_fields() -> None:
    prev = {"cniVersion": "1.0.0", "ips": [{"address": "10.244.1.5/24"}]}
    config = {"prevResult": prev, "runtimeConfig": {"portMappings": []}, "agentSocket": "/s"}
    env = {**ENV, "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAME=web-0"}
    req = parse_request(env, request(config=config))
    assert req == spec.Request(
        command="ADD",
        container_id="0f3c9e2a1b",
        netns="/var/run/netns/pod1",
        ifname="eth0",
        args={"IgnoreUnknown": "1", "K8S_POD_NAME": "web-0"},
        path=("/opt/cni/bin", "/usr/lib/cni"),
        config={**CONFIG, **config},
        cni_version="1.0.0",
        network_name="flannelpy",
        prev_result=prev,
        runtime_config={"portMappings": []},
    )
    assert parse_request(ENV, request()).runtime_config == {}
    assert parse_request(ENV, request()).prev_result is None


def test_version_needs_nothing_and_never_fails() -> None:
    for stdin in (b"", b"garbage", b'{"cniVersion": "0.4.0"}', b'{"cniVersion": 4}'):
        req = parse_request({"CNI_COMMAND": "VERSION"}, stdin)
        assert req.command == "VERSION"
        assert req.cni_version == ("0.4.0" if b"0.4.0" in stdin else spec.LATEST_VERSION)


@pytest.mark.parametrize(
    ("stdin", "version"),
    [
        (b'{"cniVersion": "1.0.0"}', "1.0.0"),
        (b'{"cniVersion": "0.2.0"}', "0.2.0"),  # echoed even if unsupported: it is version-like
        (b'{"cniVersion": "9.9.9.9.9.9.9.9"}', "9.9.9.9.9.9.9.9"),  # 15 characters
        (b'{"cniVersion": "9.9.9.9.9.9.9.99"}', "1.1.0"),  # 16
        (b'{"cniVersion": "1.0.0-rc1"}', "1.1.0"),
        (b'{"cniVersion": ""}', "1.1.0"),
        (b'{"cniVersion": 1}', "1.1.0"),
        (b"[]", "1.1.0"),
        (b"\xff", "1.1.0"),
        (b"", "1.1.0"),
    ],
)
def test_reply_version(stdin: bytes, version: str) -> None:
    assert spec.reply_version(stdin) == version


# --- errors and VERSION -------------------------------------------------------------


def test_error_json_shape() -> None:
    err = CniError(Code.TRY_AGAIN_LATER, "the agent is busy", "retry in a second")
    assert err.to_json("1.0.0") == (
        b'{"cniVersion": "1.0.0", "code": 11, "msg": "the agent is busy", '
        b'"details": "retry in a second"}'
    )
    assert (
        CniError(7, "bad").to_json("0.4.0") == b'{"cniVersion": "0.4.0", "code": 7, "msg": "bad"}'
    )
    assert str(err) == "the agent is busy"


def test_codes_are_the_specs() -> None:
    assert {c.name: int(c) for c in Code} == {
        "INCOMPATIBLE_VERSION": 1,
        "UNSUPPORTED_FIELD": 2,
        "UNKNOWN_CONTAINER": 3,
        "INVALID_ENVIRONMENT": 4,
        "IO_FAILURE": 5,
        "DECODE_FAILURE": 6,
        "INVALID_NETWORK_CONFIG": 7,
        "TRY_AGAIN_LATER": 11,
        "NOT_AVAILABLE": 50,
        "NOT_AVAILABLE_LIMITED": 51,
        "NO_ADDRESS": 100,
        "INTERNAL": 999,
    }


def test_version_reply() -> None:
    assert spec.version_reply("0.4.0") == (
        b'{"cniVersion": "0.4.0", "supportedVersions": '
        b'["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]}'
    )


# --- results ------------------------------------------------------------------------

RESULT = Result(
    cni_version="1.0.0",
    interfaces=(
        Interface("cni0", "0a:58:0a:f4:01:01"),
        Interface("veth1a2b3c4d", "6e:1d:6b:0e:2f:01"),
        Interface("eth0", "0a:58:0a:f4:01:05", "/var/run/netns/pod1"),
    ),
    ips=(IPConfig("10.244.1.5/24", "10.244.1.1", 2),),
    routes=(RouteEntry("0.0.0.0/0", "10.244.1.1"), RouteEntry("10.244.0.0/16")),
    dns={"nameservers": ["10.96.0.10"], "search": ["svc.cluster.local"]},
)
INTERFACES_JSON = (
    '"interfaces": [{"name": "cni0", "mac": "0a:58:0a:f4:01:01"}, '
    '{"name": "veth1a2b3c4d", "mac": "6e:1d:6b:0e:2f:01"}, '
    '{"name": "eth0", "mac": "0a:58:0a:f4:01:05", "sandbox": "/var/run/netns/pod1"}]'
)
TAIL_JSON = (
    '"routes": [{"dst": "0.0.0.0/0", "gw": "10.244.1.1"}, {"dst": "10.244.0.0/16"}], '
    '"dns": {"nameservers": ["10.96.0.10"], "search": ["svc.cluster.local"]}}'
)


@pytest.mark.parametrize("version", ["1.1.0", "1.0.0"])
def test_render_result_1x(version: str) -> None:
    assert render_result(RESULT, version).decode() == (
        f'{{"cniVersion": "{version}", {INTERFACES_JSON}, '
        '"ips": [{"interface": 2, "address": "10.244.1.5/24", "gateway": "10.244.1.1"}], '
        f"{TAIL_JSON}"
    )


@pytest.mark.parametrize("version", ["0.4.0", "0.3.1", "0.3.0"])
def test_render_result_legacy_names_the_family(version: str) -> None:
    assert render_result(RESULT, version).decode() == (
        f'{{"cniVersion": "{version}", {INTERFACES_JSON}, '
        '"ips": [{"version": "4", "interface": 2, "address": "10.244.1.5/24", '
        f'"gateway": "10.244.1.1"}}], {TAIL_JSON}'
    )
    v6 = Result(version, ips=(IPConfig("fd00:10:244:1::5/64"),))
    assert render_result(v6, version).decode() == (
        f'{{"cniVersion": "{version}", "ips": [{{"version": "6", '
        '"address": "fd00:10:244:1::5/64"}], "dns": {}}'
    )


def test_render_empty_result_and_unsupported_version() -> None:
    assert render_result(Result("1.1.0"), "1.1.0") == b'{"cniVersion": "1.1.0", "dns": {}}'
    with pytest.raises(CniError) as info:
        render_result(RESULT, "0.2.0")
    assert info.value.code == Code.INCOMPATIBLE_VERSION


def test_interfaces_always_carry_mac() -> None:
    doc = json.loads(render_result(Result("1.0.0", (Interface("eth0", ""),)), "1.0.0"))
    assert doc["interfaces"] == [{"name": "eth0", "mac": ""}]


def test_parse_result_reads_a_chained_plugins_output() -> None:
    # bridge + host-local at 1.1.0 with fields we do not model (mtu, route priority)
    doc = {
        "cniVersion": "1.1.0",
        "interfaces": [{"name": "eth0", "mac": "aa:bb:cc:dd:ee:ff", "mtu": 1450, "sandbox": "/n"}],
        "ips": [{"address": "10.1.0.5/16", "gateway": "10.1.0.1", "interface": 0}],
        "routes": [{"dst": "0.0.0.0/0", "priority": 10}],
        "dns": {},
    }
    assert parse_result(doc, "1.0.0") == Result(
        "1.1.0",
        (Interface("eth0", "aa:bb:cc:dd:ee:ff", "/n"),),
        (IPConfig("10.1.0.5/16", "10.1.0.1", 0),),
        (RouteEntry("0.0.0.0/0"),),
        {},
    )
    legacy = {"ips": [{"version": "4", "address": "10.1.0.5/16"}]}  # an IPAM result, no version
    assert parse_result(legacy, "0.3.1") == Result("0.3.1", ips=(IPConfig("10.1.0.5/16"),))


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"cniVersion": 1},
        {"ips": {"address": "10.1.0.5/16"}},
        {"ips": [{"gateway": "10.1.0.1"}]},
        {"ips": [{"address": "10.1.0.5"}]},
        {"ips": [{"address": "10.1.0.500/16"}]},
        {"ips": [{"address": "10.1.0.5/16", "gateway": "x"}]},
        {"ips": [{"address": "10.1.0.5/16", "interface": -1}]},
        {"ips": [{"address": "10.1.0.5/16", "interface": True}]},
        {"interfaces": [{"mac": "aa:bb:cc:dd:ee:ff"}]},
        {"interfaces": ["eth0"]},
        {"routes": [{"dst": "nowhere"}]},
        {"routes": [{"dst": "0.0.0.0/0", "gw": 1}]},
        {"dns": []},
    ],
)
def test_parse_result_rejects_malformed(doc: Any) -> None:
    with pytest.raises(CniError) as info:
        parse_result(doc, "1.0.0")
    assert info.value.code == Code.INVALID_NETWORK_CONFIG


_octet = st.integers(0, 255)
_ipv4 = st.tuples(_octet, _octet, _octet, _octet).map(lambda t: ".".join(map(str, t)))
_name = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=15)
_mac = st.lists(_octet, min_size=6, max_size=6).map(lambda b: ":".join(f"{x:02x}" for x in b))
_results = st.builds(
    Result,
    cni_version=st.just("1.0.0"),
    interfaces=st.lists(
        st.builds(Interface, _name, _mac, st.sampled_from(["", "/var/run/netns/p"])), max_size=3
    ).map(tuple),
    ips=st.lists(
        st.builds(
            IPConfig,
            st.tuples(_ipv4, st.integers(0, 32)).map(lambda t: f"{t[0]}/{t[1]}"),
            st.none() | _ipv4,
            st.none() | st.integers(0, 5),
        ),
        max_size=3,
    ).map(tuple),
    routes=st.lists(
        st.builds(
            RouteEntry,
            st.tuples(_ipv4, st.integers(0, 32)).map(lambda t: f"{t[0]}/{t[1]}"),
            st.none() | _ipv4,
        ),
        max_size=3,
    ).map(tuple),
    dns=st.fixed_dictionaries({}, optional={"nameservers": st.lists(_ipv4, max_size=2)}),
)


@settings(max_examples=200, deadline=None)
@given(result=_results, version=st.sampled_from(spec.SUPPORTED_VERSIONS))
def test_parse_result_round_trips(result: Result, version: str) -> None:
    rendered = render_result(result, version)
    assert parse_result(json.loads(rendered), "0.3.0") == dataclasses.replace(
        result, cni_version=version
    )


# --- the gate never leaks anything but CniError --------------------------------------

_cni_keys = st.sampled_from(
    ["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH"]
)
_env_values = (
    st.sampled_from(["ADD", "DEL", "CHECK", "GC", "STATUS", "eth0", "", "a=b"]) | st.text()
)
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text()
    | st.sampled_from(spec.SUPPORTED_VERSIONS),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_config_keys = st.sampled_from(
    ["cniVersion", "name", "type", "prevResult", "runtimeConfig", "agentSocket"]
)
_stdin = st.one_of(
    st.binary(max_size=200),
    st.dictionaries(_config_keys | st.text(max_size=6), _json_values, max_size=6).map(
        lambda d: json.dumps(d).encode()
    ),
    st.builds(
        lambda base, extra: json.dumps({**base, **extra}).encode(),
        st.fixed_dictionaries(
            {
                "cniVersion": st.sampled_from(spec.SUPPORTED_VERSIONS),
                "name": st.sampled_from(["net", "../x", ""]),
                "type": st.just("flannelpy-cni"),
            }
        ),
        st.dictionaries(_config_keys, _json_values, max_size=2),
    ),
)
_env = st.dictionaries(_cni_keys | st.text(max_size=10), _env_values, max_size=8)


@settings(max_examples=500, deadline=None)
@given(env=_env, stdin=_stdin)
def test_parse_request_raises_only_spec_errors(env: dict[str, str], stdin: bytes) -> None:
    try:
        req = parse_request(env, stdin)
    except CniError as e:
        assert e.code in {1, 4, 6, 7}, e.msg
        assert "\n" not in e.msg
        json.loads(e.to_json(spec.reply_version(stdin)))
    else:
        assert req.command in spec.COMMANDS
        if req.command != "VERSION":
            assert req.cni_version in spec.SUPPORTED_VERSIONS
