"""After a migration, each side's DEL releases the addresses of the pods the other side added.

A 2-node lab: n1 ours, n2 the real flanneld with the real flannel CNI plugin, two pods on
each. Then n1 goes to flanneld and n2 to ours (``flannelpy_lab.migrate``), and one old pod
of each is deleted through the plugin its node runs now:

- one of ours, through the flannel plugin: its DEL replays the delegate config the hand-back
  saved in its dataDir for that container (without it the plugin does nothing and the
  address stays taken in host-local's store for good), so host-local's file goes;
- one the flannel plugin added, through ours: host-local's file goes too.

The pods left and new pods on both nodes still reach each other.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from flannelpy_lab import Lab, flanneld
from flannelpy_lab.migrate import migrate
from flannelpy_lab.pods import pod_matrix

from tests.support.lab_util import print_agent_logs_if_failed, running_lab

pytestmark = [pytest.mark.lab]


@pytest.fixture
def lab(request: pytest.FixtureRequest) -> Iterator[Lab]:
    with running_lab(2, "vxlan", flanneld_nodes=1, pods_per_node=2) as lab:
        yield lab
        print_agent_logs_if_failed(request, lab, lines=25)


def test_each_side_releases_the_addresses_of_the_pods_the_other_added(lab: Lab) -> None:
    ours = [p for p in lab.pods if p.node == "n1"]
    theirs = [p for p in lab.pods if p.node == "n2"]
    n1, n2 = lab.node("n1"), lab.node("n2")
    # The flannel plugin saved its delegate config at each of its ADDs.
    for pod in theirs:
        assert os.path.exists(os.path.join(flanneld.flannel_data_dir(n2), pod.container_id))

    assert migrate(lab, "n1", "flanneld").exported == 2
    migrate(lab, "n2", "flannelpy")

    saved = os.path.join(flanneld.flannel_data_dir(n1), ours[0].container_id)
    stored = os.path.join(flanneld.host_local_network_dir(n1), str(ours[0].ip))
    assert os.path.exists(stored), stored
    lab.delete_pod(ours[0].name)  # through the flannel plugin now
    assert not os.path.exists(stored), f"{ours[0].ip} is still taken in host-local's store"
    assert not os.path.exists(saved), saved  # consumed by the plugin's DEL

    stored = os.path.join(flanneld.host_local_network_dir(n2), str(theirs[0].ip))
    assert os.path.exists(stored), stored
    lab.delete_pod(theirs[0].name)  # through ours now
    assert not os.path.exists(stored), f"{theirs[0].ip} is still taken in host-local's store"

    new = [lab.add_pod("n1"), lab.add_pod("n2")]
    assert len({p.ip for p in lab.pods}) == len(lab.pods) == 4
    matrix = pod_matrix(lab.pods)
    unreachable = [(a, b) for a, row in matrix.items() for b, ok in row.items() if not ok]
    assert not unreachable, (unreachable, [p.name for p in new])
