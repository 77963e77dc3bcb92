"""subnet.env: Flannel's exact format, atomic writes, loud reads."""

from __future__ import annotations

import logging
import os
import stat
from ipaddress import IPv4Interface, IPv4Network, IPv6Interface, IPv6Network
from pathlib import Path

import pytest

from flannelpy.errors import ConfigError
from flannelpy.subnet.subnet_env import (
    SubnetEnv,
    first_usable,
    read_previous_subnet,
    read_previous_subnets,
    read_subnet_env,
    render,
    write_subnet_env,
)

ENV = SubnetEnv.for_lease(IPv4Network("10.244.0.0/16"), IPv4Network("10.244.1.0/24"), 1450, True)
TEXT = (
    "FLANNEL_NETWORK=10.244.0.0/16\n"
    "FLANNEL_SUBNET=10.244.1.1/24\n"
    "FLANNEL_MTU=1450\n"
    "FLANNEL_IPMASQ=true\n"
)


def test_render_is_flannels_format() -> None:
    assert ENV.subnet == IPv4Interface("10.244.1.1/24")
    assert render(ENV) == TEXT


def test_render_dual_stack_and_ipmasq_false() -> None:
    env = SubnetEnv.for_lease(
        IPv4Network("10.244.0.0/16"),
        IPv4Network("10.244.1.0/24"),
        1400,
        False,
        ipv6_network=IPv6Network("fd00:10:244::/56"),
        ipv6_lease_subnet=IPv6Network("fd00:10:244:1::/64"),
    )
    assert render(env) == (
        "FLANNEL_NETWORK=10.244.0.0/16\n"
        "FLANNEL_SUBNET=10.244.1.1/24\n"
        "FLANNEL_IPV6_NETWORK=fd00:10:244::/56\n"
        "FLANNEL_IPV6_SUBNET=fd00:10:244:1::1/64\n"
        "FLANNEL_MTU=1400\n"
        "FLANNEL_IPMASQ=false\n"
    )
    assert env.ipv6_subnet == IPv6Interface("fd00:10:244:1::1/64")


@pytest.mark.parametrize(
    ("subnet", "expected"),
    [
        ("10.244.1.0/24", "10.244.1.1/24"),
        ("10.0.0.16/28", "10.0.0.17/28"),
        ("10.1.0.0/16", "10.1.0.1/16"),
    ],
)
def test_first_usable(subnet: str, expected: str) -> None:
    assert first_usable(IPv4Network(subnet)) == IPv4Interface(expected)


def test_write_is_complete_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "run" / "flannel" / "subnet.env"  # the directory does not exist yet
    path.parent.parent.mkdir()
    write_subnet_env(str(path), ENV)
    first_inode = path.stat().st_ino
    other = SubnetEnv.for_lease(ENV.network, IPv4Network("10.244.9.0/24"), 1450, False)
    write_subnet_env(str(path), other)
    assert path.read_text() == render(other)
    assert os.listdir(path.parent) == ["subnet.env"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    # Replaced by rename, not rewritten in place: a reader never sees a partial file.
    assert path.stat().st_ino != first_inode


def test_failed_write_keeps_the_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "subnet.env"
    write_subnet_env(str(path), ENV)

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    other = SubnetEnv.for_lease(ENV.network, IPv4Network("10.244.9.0/24"), 1450, False)
    with pytest.raises(OSError, match="No space"):
        write_subnet_env(str(path), other)
    assert path.read_text() == TEXT
    assert os.listdir(tmp_path) == ["subnet.env"]


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "subnet.env"
    write_subnet_env(str(path), ENV)
    assert read_subnet_env(str(path)) == ENV
    assert read_previous_subnet(str(path)) == IPv4Network("10.244.1.0/24")


def test_reads_flanneld_written_file_with_comments_and_quotes(tmp_path: Path) -> None:
    path = tmp_path / "subnet.env"
    path.write_text(
        '# written by flanneld\n\nFLANNEL_NETWORK="10.244.0.0/16"\n' + TEXT.split("\n", 1)[1]
    )
    assert read_subnet_env(str(path)) == ENV


def test_missing_file_is_none(tmp_path: Path) -> None:
    assert read_subnet_env(str(tmp_path / "nope.env")) is None
    assert read_previous_subnet(str(tmp_path / "nope.env")) is None


def test_missing_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "subnet.env"
    path.write_text("FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_IPV6_NETWORK=fd00::/56\n")
    with pytest.raises(ConfigError) as err:
        read_subnet_env(str(path))
    message = str(err.value)
    for key in ("FLANNEL_SUBNET", "FLANNEL_MTU", "FLANNEL_IPMASQ", "FLANNEL_IPV6_SUBNET"):
        assert key in message
    assert "FLANNEL_NETWORK," not in message


@pytest.mark.parametrize(
    ("key", "value"),
    [("FLANNEL_MTU", "big"), ("FLANNEL_IPMASQ", "yes"), ("FLANNEL_SUBNET", "10.244.1.300/24")],
)
def test_bad_value_is_named(tmp_path: Path, key: str, value: str) -> None:
    lines = [line if not line.startswith(key) else f"{key}={value}" for line in TEXT.splitlines()]
    path = tmp_path / "subnet.env"
    path.write_text("\n".join(lines))
    with pytest.raises(ConfigError, match=key):
        read_subnet_env(str(path))


@pytest.mark.parametrize(
    "content", ["FLANNEL_SUBNET=not-a-cidr\n", "FLANNEL_MTU=1450\n", b"\xff\xfe\x00garbage"]
)
def test_previous_subnet_unparsable_is_a_warning_not_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str | bytes
) -> None:
    path = tmp_path / "subnet.env"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="flannelpy.subnet.subnet_env"):
        assert read_previous_subnet(str(path)) is None
    assert "ignoring it" in caplog.text


DUAL_TEXT = (
    "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\n"
    "FLANNEL_IPV6_NETWORK=fd00:10:244::/56\nFLANNEL_IPV6_SUBNET=fd00:10:244:7::1/64\n"
    "FLANNEL_MTU=1430\nFLANNEL_IPMASQ=true\n"
)


def test_dual_stack_file_is_flannels_and_both_subnets_read_back(tmp_path: Path) -> None:
    env = SubnetEnv.for_lease(
        IPv4Network("10.244.0.0/16"),
        IPv4Network("10.244.1.0/24"),
        1430,
        True,
        IPv6Network("fd00:10:244::/56"),
        IPv6Network("fd00:10:244:7::/64"),
    )
    path = tmp_path / "subnet.env"
    write_subnet_env(str(path), env)
    assert path.read_text() == DUAL_TEXT
    assert read_subnet_env(str(path)) == env
    assert read_previous_subnets(str(path)) == (
        IPv4Network("10.244.1.0/24"),
        IPv6Network("fd00:10:244:7::/64"),
    )


def test_ipv6_only_file_has_no_ipv4_keys(tmp_path: Path) -> None:
    # Flannel's WriteSubnetFile writes the IPv4 pair only when EnableIPv4.
    env = SubnetEnv(
        None,
        None,
        1430,
        False,
        IPv6Network("fd00:10:244::/56"),
        IPv6Interface("fd00:10:244:7::1/64"),
    )
    path = tmp_path / "subnet.env"
    write_subnet_env(str(path), env)
    assert path.read_text() == (
        "FLANNEL_IPV6_NETWORK=fd00:10:244::/56\nFLANNEL_IPV6_SUBNET=fd00:10:244:7::1/64\n"
        "FLANNEL_MTU=1430\nFLANNEL_IPMASQ=false\n"
    )
    assert read_subnet_env(str(path)) == env
    assert read_previous_subnets(str(path)) == (None, IPv6Network("fd00:10:244:7::/64"))


def test_previous_ipv6_subnet_unparsable_keeps_the_ipv4_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "subnet.env"
    path.write_text(DUAL_TEXT.replace("fd00:10:244:7::1/64", "fd00::zz/64"))
    with caplog.at_level(logging.WARNING, logger="flannelpy.subnet.subnet_env"):
        assert read_previous_subnets(str(path)) == (IPv4Network("10.244.1.0/24"), None)
    assert "FLANNEL_IPV6_SUBNET" in caplog.text
