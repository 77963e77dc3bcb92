"""A VTEP's settings after each creation, written by the reconciler's pass: accept_ra=0,
as flanneld sets it (device.go), and, with --vxlan-tx-checksum-off, the transmit
checksum offload off."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from flannelpy.errors import DataplaneError
from tests.support.agent_fakes import AgentHarness
from tests.support.fakes import FakeKernel


class SysctlKernel(FakeKernel):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.sysctls: list[tuple[str, str]] = []
        self.fail = fail

    def set_sysctl(self, name: str, value: str) -> None:
        if self.fail and "ipv6" in name:
            raise DataplaneError(f"cannot set sysctl {name} to {value}: No such file")
        self.sysctls.append((name, value))


def test_the_vtep_gets_accept_ra_off_once_created_and_again_when_re_created(
    tmp_path: Path,
) -> None:
    kernel = SysctlKernel()
    h = AgentHarness(tmp_path, kernel=kernel)
    h.start()
    try:
        h.drain()
        assert ("net/ipv6/conf/flannel.1/accept_ra", "0") in kernel.sysctls
        before = kernel.sysctls.count(("net/ipv6/conf/flannel.1/accept_ra", "0"))
        h.reconcile()  # nothing to create: nothing set again
        assert kernel.sysctls.count(("net/ipv6/conf/flannel.1/accept_ra", "0")) == before
        # Someone deletes the device; the reconciler re-creates it.
        kernel.state = replace(
            kernel.state, links=frozenset(x for x in kernel.state.links if x.name != "flannel.1")
        )
        h.reconcile()
        assert kernel.sysctls.count(("net/ipv6/conf/flannel.1/accept_ra", "0")) == before + 1
    finally:
        h.stop()


def test_a_host_without_ipv6_still_starts(tmp_path: Path) -> None:
    h = AgentHarness(tmp_path, kernel=SysctlKernel(fail=True))
    h.start()
    try:
        h.drain()
        assert h.writer.reconciler.last_result is not None
        assert h.writer.reconciler.last_result.converged
    finally:
        h.stop()


def test_tx_checksum_offload_goes_off_on_each_creation_when_asked(tmp_path: Path) -> None:
    kernel = SysctlKernel()
    h = AgentHarness(tmp_path, kernel=kernel, vxlan_tx_checksum_off=True)
    h.start()
    try:
        h.drain()
        assert kernel.tx_checksum_writes == [("flannel.1", False)]
        h.reconcile()  # the device is there: nothing written again
        assert kernel.tx_checksum_writes == [("flannel.1", False)]
        kernel.state = replace(
            kernel.state, links=frozenset(x for x in kernel.state.links if x.name != "flannel.1")
        )
        h.reconcile()  # re-created: it starts with offload on again
        assert kernel.tx_checksum_writes == [("flannel.1", False), ("flannel.1", False)]
    finally:
        h.stop()


def test_without_the_flag_offload_is_left_alone(tmp_path: Path) -> None:
    kernel = SysctlKernel()
    h = AgentHarness(tmp_path, kernel=kernel)
    h.start()
    try:
        h.drain()
        assert {link.name for link in kernel.state.links} == {"flannel.1"}
        assert kernel.tx_checksum_writes == []
    finally:
        h.stop()
