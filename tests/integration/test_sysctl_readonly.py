"""The kernel boundary's sysctl verb in a container's view of /proc/sys (read-only, as
containerd mounts it for an unprivileged container such as the DaemonSet's agent): a value
already set is success, a change is refused naming the sysctl."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.netns_util import is_root

pytestmark = pytest.mark.skipif(not is_root(), reason="needs root (mount and network namespaces)")

# Runs in a fresh network and mount namespace, /proc/sys bound read-only over itself.
SCRIPT = """
import sys
from flannelpy.dataplane.netlink_host import set_sysctl
from flannelpy.errors import DataplaneError
with open("/proc/sys/net/ipv4/ip_forward") as f:
    now = f.read().strip()
set_sysctl("net.ipv4.ip_forward", now)
try:
    set_sysctl("net.ipv4.ip_forward", "0" if now == "1" else "1")
except DataplaneError as e:
    print(e)
    sys.exit(0)
sys.exit("a change was written to a read-only /proc/sys")
"""


def test_sysctl_already_set_needs_no_write_and_a_change_names_the_sysctl() -> None:
    shell = (
        "mount --make-rprivate / && mount --bind /proc/sys /proc/sys && "
        'mount -o remount,ro,bind /proc/sys && exec "$0" -c "$1"'
    )
    done = subprocess.run(
        ["unshare", "--net", "--mount", "sh", "-c", shell, sys.executable, SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "cannot set sysctl net.ipv4.ip_forward" in done.stdout
    assert "Read-only file system" in done.stdout
