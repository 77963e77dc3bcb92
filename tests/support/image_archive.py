"""A container image built locally, as a ``docker save`` archive (no registry is reachable).

``write_image_archive(path, "localhost/name:tag", layer_tar, entrypoint)`` writes the
archive ``ctr images import`` and ``docker load`` read: one uncompressed layer, an
image config naming it by digest, and ``manifest.json`` tying both to the tag.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Sequence


def write_image_archive(path: str, tag: str, layer_tar: str, entrypoint: Sequence[str]) -> str:
    """Write the archive at ``path``; returns the image's config digest (its ID)."""
    with open(layer_tar, "rb") as f:
        layer = f.read()
    layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": list(entrypoint), "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            "history": [{"created_by": "flannelpy tests (tests/support/image_archive.py)"}],
        },
        sort_keys=True,
    ).encode()
    config_digest = hashlib.sha256(config).hexdigest()
    layer_name = f"{layer_digest.removeprefix('sha256:')}/layer.tar"
    manifest = json.dumps(
        [{"Config": f"{config_digest}.json", "RepoTags": [tag], "Layers": [layer_name]}]
    ).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in (
            (f"{config_digest}.json", config),
            (layer_name, layer),
            ("manifest.json", manifest),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return "sha256:" + config_digest
