"""bench.lease_events' table: medians per side, the idle rate's share, the ratios."""

from __future__ import annotations

import json
import re

import pytest

from bench.lease_events import Run, idle_share, report


def run(impl: str, add: list[float], cpu: float, idle: float = 0.0) -> Run:
    return Run(impl, 1000, add, [a / 2 for a in add], cpu, idle, wall_seconds=10.0)


def test_the_table_gives_each_sides_median_and_the_ratio() -> None:
    runs = [
        run("ours", [4.0, 6.0, 8.0], cpu=3.0, idle=6.0),
        run("flanneld", [2.0, 3.0, 4.0], cpu=1.0),
        run("ours", [6.0, 8.0, 10.0], cpu=5.0, idle=6.0),
        run("flanneld", [2.0, 3.0, 4.0], cpu=1.0),
    ]
    rows = {}
    for line in report(runs).splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells
    add = rows["new lease -> route, p50 (ms)"]
    assert add[-3:] == ["7.00", "3.00", "2.33"]  # medians of the runs' medians 6 and 8
    assert rows["CPU per event (ms)"][-3:] == ["4.00", "1.00", "4.00"]
    assert rows["deleted lease -> no route, p50 (ms)"][-3:] == ["3.50", "1.50", "2.33"]


def test_the_idle_share_is_the_idle_rate_over_the_sequence_per_event() -> None:
    # 6 ms of CPU a second at idle, 10 s for 3 adds and 3 deletes: 10 ms per event.
    assert idle_share(run("ours", [1.0, 1.0, 1.0], cpu=12.0, idle=6.0)) == pytest.approx(10.0)


def test_with_the_floor_the_table_adds_its_column_and_its_ratio() -> None:
    runs = [
        run("ours", [6.0], cpu=4.0),
        run("flanneld", [3.0], cpu=2.0),
        run("floor", [3.0], cpu=0.5),
    ]
    rows = {
        cells[0]: cells
        for cells in (re.split(r"\s{2,}", line.strip()) for line in report(runs).splitlines())
    }
    assert rows["CPU per event (ms)"][-5:] == ["4.00", "2.00", "2.00", "0.50", "0.25"]
    # No idle CPU in these runs: above idle is the whole figure.
    assert rows["CPU per event above idle (ms)"][-5:] == ["4.00", "2.00", "2.00", "0.50", "0.25"]


def test_the_floor_writes_a_peers_three_entries_route_last_and_removes_them_route_first() -> None:
    from bench.event_floor import Floor
    from flannelpy.dataplane import rtnl

    floor = Floor("http://127.0.0.1:1", "/coreos.com/network/subnets/")
    floor.ifindex = 7
    floor.close()  # no message is sent here: requests() only packs them
    key = "/coreos.com/network/subnets/10.5.3.0-24"
    lease = json.dumps(
        {"PublicIP": "198.18.0.9", "BackendData": {"VtepMAC": "02:aa:bb:cc:dd:ee"}}
    ).encode()
    put = floor.requests(key, lease)
    assert [r.msg_type for r in put] == [rtnl.RTM_NEWNEIGH, rtnl.RTM_NEWNEIGH, rtnl.RTM_NEWROUTE]
    assert put[0].body[0] == rtnl.AF_BRIDGE  # the FDB entry first, then the neighbour
    gone = floor.requests(key, None)
    assert [r.msg_type for r in gone] == [rtnl.RTM_DELROUTE, rtnl.RTM_DELNEIGH, rtnl.RTM_DELNEIGH]
    assert floor.requests(key, None) == []  # a delete of an unknown key writes nothing
