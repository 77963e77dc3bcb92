"""``flannelpy pools``: list, add, tag, untag and remove address pools in etcd.

The semantics (field-notes §3) live in :mod:`flannelpy.subnet.pools`, the keys
in :mod:`flannelpy.store.etcd.pools`; this module parses the command line,
connects with the agent's ``--etcd-*`` flags (or FLANNELD_ETCD_* variables), and
prints.

Heavy imports (the etcd client) happen in :func:`run`, not when the ``flannelpy``
parser is built.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from flannelpy.commands.store import connected, store_parent, store_settings
from flannelpy.config.settings import AgentSettings, check_cluster_name
from flannelpy.errors import FlannelpyError
from flannelpy.subnet.pools import (
    ROLE_EXCLUDED,
    ROLE_KEY,
    ROLE_OPT_IN,
    PoolCapacity,
    capacity,
    eligibility,
    leasable_range,
    parse_pool_cidr,
    parse_tag,
)

if TYPE_CHECKING:
    from flannelpy.store.etcd.pools import PoolStore

KUBE_REFUSAL = (
    "pools apply to etcd mode only: in Kubernetes mode the controller-manager "
    "allocates each node's podCIDR; unset FLANNELD_KUBE_SUBNET_MGR to reach etcd"
)

DESCRIPTION = (
    "Manage the address pools new node leases are cut from. The network config's Network "
    f"is the primary pool: it takes new leases unless tagged {ROLE_KEY}={ROLE_EXCLUDED}. "
    f"Another pool takes new leases only once tagged {ROLE_KEY}={ROLE_OPT_IN}; tagged "
    f"{ROLE_KEY}={ROLE_EXCLUDED} it drains (nothing new lands, running pods keep their "
    "addresses); untagged it takes nothing new but its leases keep serving. A "
    "flannelpy.io/cluster/<name> tag reserves a pool for the named cluster(s). "
    "Pools apply to etcd mode only: in Kubernetes mode (--kube-subnet-mgr) the "
    "controller-manager allocates each node's podCIDR, and pools do not apply."
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    pools = subparsers.add_parser(
        "pools",
        help="list and manage address pools (etcd mode only)",
        description=DESCRIPTION,
    )
    verbs = pools.add_subparsers(dest="pools_command", required=True, metavar="VERB")
    store = store_parent()
    listing = verbs.add_parser(
        "list",
        parents=[store],
        description=DESCRIPTION,
        help="each pool's size, subnets taken and free, tags, and whether new leases may "
        "land there; warns when a pool is more than half used",
    )
    listing.add_argument("--json", action="store_true", help="print the pools as JSON")
    listing.add_argument(
        "--cluster-name",
        metavar="NAME",
        help="show which pools the agents of cluster NAME may use (default: agents "
        "without a cluster name)",
    )
    add = verbs.add_parser(
        "add",
        parents=[store],
        description=DESCRIPTION,
        help=f"add a pool; untagged, it takes no new leases until tagged {ROLE_KEY}={ROLE_OPT_IN}",
    )
    add.add_argument("cidr", metavar="CIDR", help="the pool, like 10.250.0.0/16")
    tag = verbs.add_parser(
        "tag", parents=[store], description=DESCRIPTION, help="set one tag on a pool"
    )
    tag.add_argument("cidr", metavar="CIDR")
    tag.add_argument(
        "tag",
        metavar="KEY=VALUE",
        help=f"{ROLE_KEY}=1 or 0, or flannelpy.io/cluster/<name>=VALUE",
    )
    untag = verbs.add_parser(
        "untag", parents=[store], description=DESCRIPTION, help="remove one tag from a pool"
    )
    untag.add_argument("cidr", metavar="CIDR")
    untag.add_argument("key", metavar="KEY")
    remove = verbs.add_parser(
        "remove",
        parents=[store],
        description=DESCRIPTION,
        help="remove a drained pool: never the primary, one tagged "
        f"{ROLE_KEY}={ROLE_OPT_IN}, or one that still holds leases",
    )
    remove.add_argument("cidr", metavar="CIDR")
    pools.set_defaults(run=run)
    return pools


def run(args: argparse.Namespace) -> int:
    try:
        settings = store_settings(args, os.environ, KUBE_REFUSAL)
        with open_pools(settings) as pools:
            return VERBS[args.pools_command](args, pools)
    except FlannelpyError as e:
        print(f"flannelpy pools: {e}", file=sys.stderr)
        return e.exit_code


@contextmanager
def open_pools(settings: AgentSettings) -> Iterator[PoolStore]:
    from flannelpy.store.etcd.pools import PoolStore

    with connected(settings) as store:
        yield PoolStore(store, settings.etcd_prefix)


# --- verbs ------------------------------------------------------------------------------------


def list_verb(args: argparse.Namespace, pools: PoolStore) -> int:
    cluster = check_cluster_name(args.cluster_name) if args.cluster_name else None
    config = pools.network_config()
    snap = pools.snapshot(config)
    caps = capacity(config, snap.pools, snap.leases)
    for why in snap.ignored:
        print(f"flannelpy pools: ignoring an unreadable pool record {why}", file=sys.stderr)
    sys.stdout.write(render_json(caps, cluster) if args.json else render_text(caps, cluster))
    return 0


def add_verb(args: argparse.Namespace, pools: PoolStore) -> int:
    network = parse_pool_cidr(args.cidr)
    config = pools.network_config()
    pool = pools.add(config, network)
    span = leasable_range(pool, config)
    print(
        f"added pool {network} ({span.count} subnets of /{span.length}); it has no "
        f"{ROLE_KEY} tag, so no new lease lands there yet: opt it in with "
        f"`flannelpy pools tag {network} {ROLE_KEY}={ROLE_OPT_IN}`"
    )
    return 0


def tag_verb(args: argparse.Namespace, pools: PoolStore) -> int:
    network = parse_pool_cidr(args.cidr)
    key, value = parse_tag(args.tag)
    config = pools.network_config()
    edit = pools.tag(config, network, key, value)
    done = "tagged" if edit.changed else "already tagged, nothing changed:"
    print(f"{done} {network} {key}={value}; now {eligibility(edit.pool, None).reason}")
    return 0


def untag_verb(args: argparse.Namespace, pools: PoolStore) -> int:
    network = parse_pool_cidr(args.cidr)
    config = pools.network_config()
    edit = pools.untag(config, network, args.key)
    if not edit.changed:
        print(f"{network} has no tag {args.key}; nothing changed")
        return 0
    line = f"removed tag {args.key} from {network}; now {eligibility(edit.pool, None).reason}"
    if args.key == ROLE_KEY and not edit.pool.primary:
        # §3: removing the tag blocks new leases but does not drain the pool.
        line += f" (to drain it, tag it {ROLE_KEY}={ROLE_EXCLUDED})"
    print(line)
    return 0


def remove_verb(args: argparse.Namespace, pools: PoolStore) -> int:
    network = parse_pool_cidr(args.cidr)
    config = pools.network_config()
    pools.remove(config, network)
    print(f"removed pool {network}")
    return 0


VERBS: dict[str, Callable[[argparse.Namespace, PoolStore], int]] = {
    "list": list_verb,
    "add": add_verb,
    "tag": tag_verb,
    "untag": untag_verb,
    "remove": remove_verb,
}


# --- rendering (pure) -----------------------------------------------------------------------


def pool_json(cap: PoolCapacity, cluster: str | None) -> dict[str, Any]:
    verdict = eligibility(cap.pool, cluster)
    return {
        "network": str(cap.pool.network),
        "primary": cap.pool.primary,
        "subnet_len": cap.length,
        "tags": dict(sorted(cap.pool.tags.items())),
        "size": cap.size,
        "taken": cap.taken,
        "free": cap.free,
        "leases": cap.leases,
        "utilisation": round(cap.utilisation, 4),
        "create_leases": verdict.create_leases,
        "allocate_addresses": verdict.allocate_addresses,
        "reason": verdict.reason,
        "warning": cap.warning,
    }


def render_json(caps: Sequence[PoolCapacity], cluster: str | None) -> str:
    doc = {"cluster": cluster, "pools": [pool_json(cap, cluster) for cap in caps]}
    return json.dumps(doc, indent=2) + "\n"


def render_text(caps: Sequence[PoolCapacity], cluster: str | None) -> str:
    who = f"cluster {cluster}" if cluster else "agents without a cluster name"
    rows = [("POOL", "SUBNETS", "TAKEN", "FREE", "USED", "NEW LEASES", "TAGS")]
    for cap in caps:
        name = f"{cap.pool.network} (primary)" if cap.pool.primary else str(cap.pool.network)
        tags = ",".join(f"{k}={v}" for k, v in sorted(cap.pool.tags.items())) or "-"
        new = "yes" if eligibility(cap.pool, cluster).create_leases else "no"
        rows.append(
            (
                name,
                f"{cap.size} x /{cap.length}",
                str(cap.taken),
                str(cap.free),
                f"{cap.utilisation:.0%}",
                new,
                tags,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [f"pools as {who} see them"]
    for row in rows:
        cells = [
            cell.rjust(w) if 1 <= i <= 4 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=False))
        ]
        lines.append("  ".join([*cells, row[-1]]))
    lines += [f"  {eligibility(cap.pool, cluster).reason}" for cap in caps]
    lines += [f"warning: {cap.warning}" for cap in caps if cap.warning]
    return "\n".join(lines) + "\n"
