"""A ConfigMap projected into a directory as the kubelet projects a ConfigMap volume.

``lab up --kube`` runs this as a process of its own (``python -m flannelpy_lab.projector``):
it lists then watches the ConfigMap on kube-apiserver and writes every change with the
kubelet's AtomicWriter layout (pkg/volume/util/atomic_writer.go), so an agent reading
``<dir>/net-conf.json`` sees what it would see in a pod:

    <dir>/..2026_12_02_03_04_05.123456/net-conf.json   the payload, one directory per version
    <dir>/..data -> ..2026_12_02_03_04_05.123456        swapped by one rename(2)
    <dir>/net-conf.json -> ..data/net-conf.json          fixed, never rewritten

A reader opens either the old or the new version, never half a file. A deleted ConfigMap
leaves the last version in place, as the kubelet leaves a mounted volume.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import ssl
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

DATA = "..data"
DATA_TMP = "..data_tmp"
WATCH_SECONDS = 60  # the server ends each watch after this; we resume from its last version
RETRY_SECONDS = 1.0


# -- the AtomicWriter part (pure file operations, no API) -------------------------------------


def current(directory: str) -> dict[str, str] | None:
    """The payload the directory shows now; None when nothing was projected yet."""
    data = os.path.join(directory, DATA)
    if not os.path.islink(data):
        return None
    version = os.path.join(directory, os.readlink(data))
    try:
        names = os.listdir(version)
    except FileNotFoundError:
        return None
    payload = {}
    for name in names:
        with open(os.path.join(version, name), encoding="utf-8") as f:
            payload[name] = f.read()
    return payload


def project(directory: str, payload: Mapping[str, str]) -> bool:
    """Make ``directory`` show ``payload`` (file name -> text); False when it already did."""
    for name in payload:
        if not name or name.startswith("..") or "/" in name:
            raise ValueError(f"{name!r} is no ConfigMap key a volume can project")
    if current(directory) == dict(payload):
        return False
    data = os.path.join(directory, DATA)
    old = os.readlink(data) if os.path.islink(data) else None
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime())
    version = tempfile.mkdtemp(prefix=stamp, dir=directory)
    os.chmod(version, 0o755)
    for name, text in payload.items():
        path = os.path.join(version, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, 0o644)
    tmp = os.path.join(directory, DATA_TMP)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(os.path.basename(version), tmp)
    os.rename(tmp, data)  # the one step a reader can observe
    for name in payload:
        _link_visible(directory, name)
    for name in set(_visible(directory)) - set(payload):  # a key the ConfigMap lost
        os.unlink(os.path.join(directory, name))
    if old and old != os.path.basename(version):
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    return True


def _link_visible(directory: str, name: str) -> None:
    """``<dir>/<name> -> ..data/<name>``; replaces a plain file of that name in one step."""
    path = os.path.join(directory, name)
    target = os.path.join(DATA, name)
    if os.path.islink(path) and os.readlink(path) == target:
        return
    tmp = os.path.join(directory, f".{name}.link")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, path)


def _visible(directory: str) -> list[str]:
    """The user-visible names: symlinks into ``..data``."""
    out = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.islink(path) and os.readlink(path).startswith(DATA + "/"):
            out.append(name)
    return out


# -- the API part ------------------------------------------------------------------------------


class Api:
    """GET requests to kube-apiserver with a kubeconfig's server, CA and bearer token."""

    def __init__(self, kubeconfig: str) -> None:
        with open(kubeconfig, encoding="utf-8") as f:
            doc = json.load(f)
        cluster = doc["clusters"][0]["cluster"]
        self.server = cluster["server"].rstrip("/")
        self.token = doc["users"][0]["user"]["token"]
        context = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )

    def open(self, path: str, timeout: float) -> Any:
        request = urllib.request.Request(self.server + path)
        request.add_header("Authorization", f"Bearer {self.token}")
        return self.opener.open(request, timeout=timeout)


def configmap_payload(obj: Mapping[str, Any]) -> dict[str, str]:
    data = obj.get("data") or {}
    return {str(k): str(v) for k, v in data.items() if isinstance(v, str)}


def follow(api: Api, namespace: str, name: str) -> Iterator[tuple[str, dict[str, str]]]:
    """(resourceVersion, payload) of the ConfigMap now and after every change; forever."""
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    selector = urllib.parse.quote(f"metadata.name={name}")
    while True:
        try:
            with api.open(f"{base}?fieldSelector={selector}", timeout=10) as resp:
                listed = json.load(resp)
            rv = listed["metadata"]["resourceVersion"]
            for item in listed.get("items") or []:
                yield rv, configmap_payload(item)
            while True:
                query = (
                    f"?fieldSelector={selector}&watch=1&allowWatchBookmarks=true"
                    f"&resourceVersion={rv}&timeoutSeconds={WATCH_SECONDS}"
                )
                with api.open(base + query, timeout=WATCH_SECONDS + 15) as resp:
                    for line in resp:
                        event = json.loads(line)
                        obj = event.get("object") or {}
                        if event.get("type") == "ERROR":  # 410 Gone: list again
                            raise LookupError(obj.get("message") or "watch error")
                        rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                        if event.get("type") in ("ADDED", "MODIFIED"):
                            yield rv, configmap_payload(obj)
        except (OSError, urllib.error.URLError, ValueError, KeyError, LookupError) as e:
            print(f"projector: {e}; listing again in {RETRY_SECONDS:g} s", flush=True)
            time.sleep(RETRY_SECONDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--configmap", required=True)
    parser.add_argument("--dir", required=True, help="the volume directory")
    args = parser.parse_args(argv)
    api = Api(args.kubeconfig)
    print(f"projector: {args.namespace}/{args.configmap} into {args.dir}", flush=True)
    for rv, payload in follow(api, args.namespace, args.configmap):
        try:
            if project(args.dir, payload):
                print(f"projector: projected resourceVersion {rv}: {sorted(payload)}", flush=True)
        except (OSError, ValueError) as e:  # a full disk, a bad key: keep the last version
            print(f"projector: cannot project resourceVersion {rv}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
