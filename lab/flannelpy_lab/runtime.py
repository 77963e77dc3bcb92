"""A minimal container runtime's CNI side, for the lab: run a conflist the way libcni does.

ADD runs the plugins in order, each getting the previous one's result as
``prevResult``; the final result is cached. DEL runs them in reverse with the
cached result (converted to the conflist's version, as libcni does); CHECK in
order with it. Plugins are executed inside the lab node's network namespace (as
a runtime on that node would run them), with the ``CNI_*`` variables and the
plugin's config on stdin.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flannelpy_lab.errors import LabError

PLUGIN_TIMEOUT = 60.0  # seconds; the kubelet's default CRI timeout is 2 minutes


@dataclass(frozen=True)
class Attachment:
    container_id: str
    netns: str  # path, e.g. /run/netns/fpl-demo-n1-p1
    ifname: str
    capability_args: dict[str, Any]  # e.g. {"portMappings": [...]}
    cni_args: str = ""  # CNI_ARGS, e.g. the kubelet's K8S_POD_NAMESPACE=...;K8S_POD_NAME=...


class CniRuntime:
    def __init__(self, conflist_path: str, cni_path: str, cache_dir: str, node_netns: str) -> None:
        self.conflist_path = conflist_path
        self.cni_path = cni_path
        self.cache_dir = Path(cache_dir)
        self.node_netns = node_netns

    def conflist(self) -> dict[str, Any]:
        return json.loads(Path(self.conflist_path).read_text())  # type: ignore[no-any-return]

    def add(self, att: Attachment) -> dict[str, Any]:
        conflist = self.conflist()
        result: dict[str, Any] | None = None
        for plugin in conflist["plugins"]:
            result = self._exec("ADD", plugin, conflist, att, result)
        assert result is not None
        self._cache_path(conflist, att).parent.mkdir(parents=True, exist_ok=True)
        self._cache_path(conflist, att).write_text(json.dumps(result))
        return result

    def check(self, att: Attachment) -> None:
        conflist = self.conflist()
        cached = self._cached(conflist, att)
        for plugin in conflist["plugins"]:
            self._exec("CHECK", plugin, conflist, att, cached)

    def delete(self, att: Attachment) -> None:
        conflist = self.conflist()
        cached = self._cached(conflist, att)
        for plugin in reversed(conflist["plugins"]):
            self._exec("DEL", plugin, conflist, att, cached)
        self._cache_path(conflist, att).unlink(missing_ok=True)

    def _cache_path(self, conflist: dict[str, Any], att: Attachment) -> Path:
        return self.cache_dir / f"{conflist['name']}-{att.container_id}-{att.ifname}.json"

    def _cached(self, conflist: dict[str, Any], att: Attachment) -> dict[str, Any] | None:
        """The cached result in the conflist's version, as libcni converts it: a node's
        conflist may have changed version since the ADD (a migrated node), and a plugin
        refuses a prevResult of a version its config does not have."""
        path = self._cache_path(conflist, att)
        if not path.exists():
            return None
        return convert_result(json.loads(path.read_text()), conflist["cniVersion"])

    def _exec(
        self,
        command: str,
        plugin: dict[str, Any],
        conflist: dict[str, Any],
        att: Attachment,
        prev: dict[str, Any] | None,
    ) -> dict[str, Any] | None:
        conf = dict(plugin)
        conf["cniVersion"] = conflist["cniVersion"]
        conf["name"] = conflist["name"]
        if prev is not None:
            conf["prevResult"] = prev
        wanted = {k for k, v in plugin.get("capabilities", {}).items() if v}
        runtime_config = {k: v for k, v in att.capability_args.items() if k in wanted}
        if runtime_config:
            conf["runtimeConfig"] = runtime_config
        binary = self._find(plugin["type"])
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": att.container_id,
            "CNI_NETNS": att.netns,
            "CNI_IFNAME": att.ifname,
            "CNI_PATH": self.cni_path,
            **({"CNI_ARGS": att.cni_args} if att.cni_args else {}),
        }
        proc = subprocess.run(
            ["ip", "netns", "exec", self.node_netns, binary],
            input=json.dumps(conf).encode(),
            env=env,
            capture_output=True,
            timeout=PLUGIN_TIMEOUT,
        )
        out = proc.stdout.decode(errors="replace").strip()
        if proc.returncode != 0:
            raise LabError(
                f"CNI {command} of {plugin['type']} for {att.container_id} failed "
                f"(exit {proc.returncode}): {out or proc.stderr.decode(errors='replace')[-300:]}"
            )
        if command == "ADD":
            return json.loads(out)  # type: ignore[no-any-return]
        return prev

    def _find(self, plugin_type: str) -> str:
        for directory in self.cni_path.split(":"):
            candidate = os.path.join(directory, plugin_type)
            if os.access(candidate, os.X_OK):
                return candidate
        raise LabError(f"CNI plugin {plugin_type!r} not found in CNI_PATH {self.cni_path}")


def convert_result(result: dict[str, Any], version: str) -> dict[str, Any]:
    """A 0.3.x/0.4.0 or 1.x result in ``version``: before 1.0.0 each IP carries its family
    as ``version`` ("4" or "6"), from 1.0.0 on it carries none."""
    converted = dict(result, cniVersion=version)
    if "ips" in result:
        legacy = version.startswith("0.")
        converted["ips"] = [_convert_ip(dict(ip), legacy) for ip in result["ips"]]
    return converted


def _convert_ip(ip: dict[str, Any], legacy: bool) -> dict[str, Any]:
    if legacy:
        ip.setdefault("version", "6" if ":" in str(ip.get("address", "")) else "4")
    else:
        ip.pop("version", None)
    return ip
