"""``flannelpy-lab status`` on a lab without pods (``--pods-per-node 0``).

No pod is attached anywhere, so there is no cni0 to ping: flanneld makes none before
its first pod, and ours is down without a port. Node pairs are judged from where they
can be: between the VTEPs over vxlan (a real packet through the overlay), by the
routes and the gateways answering on the underlay over host-gw; the document and the
text say which, and ``--json`` exits 0 when every pair holds.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from flannelpy_lab import Lab, cli

from tests.support.lab_util import converged_status, running_lab

pytestmark = [pytest.mark.lab]


def bridge_usable(lab: Lab, node: str) -> bool:
    out = lab.exec(node, ["ip", "-j", "link", "show"]).stdout
    links: list[dict[str, Any]] = json.loads(out or "[]")
    return any(lk["ifname"] == "cni0" and lk.get("operstate") == "UP" for lk in links)


@pytest.mark.parametrize(("backend", "judged"), [("vxlan", "ping"), ("host-gw", "route")])
def test_status_without_pods_judges_node_pairs_without_pinging_cni0(
    backend: str, judged: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_lab(3, backend, flanneld_nodes=1, pods_per_node=0) as lab:
        assert [n.agent_kind for n in lab.nodes] == ["flannelpy", "flannelpy", "flanneld"]
        assert not any(bridge_usable(lab, n.name) for n in lab.nodes)
        doc = converged_status(lab, keys=("matrix",))
        assert {w for row in doc["matrix_judged_by"].values() for w in row.values()} == {judged}
        points = doc["probe_points"]
        if backend == "vxlan":  # every node's VTEP holds its lease's network address
            for node in doc["nodes"]:
                vtep = node["lease"].split("/")[0]
                assert points[node["name"]] == f"flannel.1 {vtep} (backend device)", points
        else:
            assert all(p.startswith("no lease address up") for p in points.values()), points
        assert doc["ok"] and doc["pod_matrix"] == {}
        capsys.readouterr()
        assert cli.main(["status", "--name", lab.name]) == 0
        text = capsys.readouterr().out
        assert ("n1  .   ok  ok" in text) if backend == "vxlan" else ("n2  rt  .   rt" in text), (
            text
        )
