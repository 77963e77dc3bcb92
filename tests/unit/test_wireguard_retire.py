"""A live switch away from wireguard retires the device after a grace, unless used again."""

from __future__ import annotations

from ipaddress import IPv4Interface
from pathlib import Path

import pytest

from flannelpy.backend import wireguard
from flannelpy.backend.wireguard import WireguardRuntime, retire_unless
from flannelpy.dataplane.wireguard import WgDeviceSpec

SPEC = WgDeviceSpec(name="flannel-wg", listen_port=51820, mtu=1440,
                    address=IPv4Interface("10.5.1.0/32"))  # fmt: skip


class FakeDevice:
    name = "flannel-wg"

    def __init__(self) -> None:
        self.stopped = 0
        self.specs: list[WgDeviceSpec] = []

    def set_desired(self, spec: WgDeviceSpec) -> None:
        self.specs.append(spec)

    def stop(self) -> None:
        self.stopped += 1


def started(tmp_path: Path) -> tuple[WireguardRuntime, FakeDevice]:
    device = FakeDevice()
    rt = WireguardRuntime(str(tmp_path / "k"), str(tmp_path / "run"), sink=device)
    rt.device = device
    rt.set_desired(SPEC)
    return rt, device


def test_the_device_is_stopped_and_forgotten_after_the_grace(tmp_path: Path) -> None:
    rt, device = started(tmp_path)
    timer = rt.retire(after=0.01)
    assert timer is not None
    assert device.stopped == 0  # not at once: peers still on wireguard send through it
    timer.join(2)
    assert device.stopped == 1 and rt.device is None


def test_planning_wireguard_again_within_the_grace_keeps_the_device(tmp_path: Path) -> None:
    rt, device = started(tmp_path)
    timer = rt.retire(after=0.05)
    assert timer is not None
    rt.set_desired(SPEC)  # switched back before the grace ended
    timer.join(2)
    assert device.stopped == 0 and rt.device is device and device.specs == [SPEC, SPEC]


def test_a_runtime_that_never_started_a_device_has_nothing_to_retire(tmp_path: Path) -> None:
    rt = WireguardRuntime(str(tmp_path / "k"), str(tmp_path / "run"), sink=FakeDevice())
    assert rt.retire(after=0.0) is None


def test_only_another_backend_retires_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt, _ = started(tmp_path)
    calls: list[float] = []
    monkeypatch.setattr(rt, "retire", lambda after=0.0: calls.append(after))
    monkeypatch.setattr(wireguard, "_runtime", rt)
    retire_unless("wireguard")
    assert calls == []
    retire_unless("vxlan")
    assert calls == [0.0]
