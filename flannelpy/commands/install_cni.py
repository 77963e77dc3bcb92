"""``flannelpy install-cni-conf SOURCE TARGET``: the DaemonSet's init container installs
the CNI conflist on the host, as Flannel's ``install-conf`` does since v0.28.6.

A kubelet (or containerd's CRI plugin) watches ``/etc/cni/net.d`` and may read the
conflist at any moment, so the file is written whole or not at all: checked first (a
ConfigMap value cut short, or edited into something that is no conflist, is refused
and the installed file stays), then written to a temp file in the same directory,
fsynced and renamed over the old one (:func:`flannelpy.fsutil.atomic_write`). The temp
name starts with a dot and ends in ``.tmp``, which no runtime loads. Each ``--move-aside``
file (Flannel's own ``10-flannel.conflist``, which sorts before ours and would win) is
then renamed to ``NAME.disabled-by-flannelpy``: renaming it back restores Flannel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flannelpy.errors import ConfigError, FlannelpyError
from flannelpy.fsutil import atomic_write, fsync_dir

DISABLED_SUFFIX = ".disabled-by-flannelpy"
MAX_CONFLIST_BYTES = 1 << 20  # a conflist is a few hundred bytes; a megabyte is no conflist


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    install: argparse.ArgumentParser = subparsers.add_parser(
        "install-cni-conf",
        help="install a CNI conflist atomically (the DaemonSet's init container)",
        description="Check SOURCE is a CNI conflist, then replace TARGET with it in one "
        "rename, so a kubelet never reads half a file; then rename each --move-aside file "
        f"that exists to NAME{DISABLED_SUFFIX}.",
    )
    install.add_argument("source", type=Path, help="the conflist to install (the ConfigMap's)")
    install.add_argument("target", type=Path, help="where the runtime reads it")
    install.add_argument(
        "--move-aside",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="a conflist that would win over ours (repeatable)",
    )
    install.set_defaults(run=run)
    return install


def run(args: argparse.Namespace) -> int:
    try:
        moved = install_conflist(args.source, args.target, args.move_aside)
    except FlannelpyError as e:
        print(f"flannelpy install-cni-conf: {e}", file=sys.stderr)
        return e.exit_code
    print(f"installed {args.target}", file=sys.stderr)
    for path in moved:
        print(f"moved {path} aside to {path}{DISABLED_SUFFIX}", file=sys.stderr)
    return 0


def install_conflist(source: Path, target: Path, move_aside: Sequence[Path] = ()) -> list[Path]:
    """Install ``source`` at ``target`` atomically, then move ``move_aside`` files out of
    the runtime's way; the paths moved. Raises ConfigError (nothing changed) when
    ``source`` is unreadable or no conflist."""
    data = _read(source)
    check_conflist(data, source)
    atomic_write(target, data, mode=0o644)
    moved = []
    for path in move_aside:
        if path.exists() and path != target:
            os.replace(path, path.with_name(path.name + DISABLED_SUFFIX))
            fsync_dir(path.parent)
            moved.append(path)
    return moved


def _read(source: Path) -> bytes:
    try:
        with source.open("rb") as f:
            data = f.read(MAX_CONFLIST_BYTES + 1)
    except OSError as e:
        raise ConfigError(
            f"cannot read the CNI conflist {source} ({e.strerror}); check the ConfigMap is "
            "mounted there"
        ) from e
    if len(data) > MAX_CONFLIST_BYTES:
        raise ConfigError(f"{source} is over {MAX_CONFLIST_BYTES} bytes, so no CNI conflist")
    return data


def check_conflist(data: bytes, source: Path | str) -> None:
    """What a runtime needs to load a conflist: a JSON object with ``cniVersion`` and
    ``name`` strings and a non-empty ``plugins`` list of objects each naming its
    ``type``. Raises ConfigError naming the first thing missing."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{source} is not valid JSON ({e}); fix cni-conf.json in the ConfigMap"
        ) from e
    if not isinstance(doc, dict):
        raise ConfigError(f"{source} must hold a JSON object; fix cni-conf.json in the ConfigMap")
    for key in ("cniVersion", "name"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise ConfigError(f"{source} has no {key!r} string; fix cni-conf.json in the ConfigMap")
    plugins = doc.get("plugins")
    if not isinstance(plugins, list) or not plugins:
        raise ConfigError(
            f"{source} has no 'plugins' list (a single-plugin .conf is not a conflist); fix "
            "cni-conf.json in the ConfigMap"
        )
    for index, plugin in enumerate(plugins):
        if not isinstance(plugin, dict) or not isinstance(plugin.get("type"), str):
            raise ConfigError(
                f"{source}: plugin {index} names no 'type'; fix cni-conf.json in the ConfigMap"
            )
