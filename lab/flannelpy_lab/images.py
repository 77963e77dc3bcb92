"""The images the lab's kubelets run, made without a registry.

- the pause image and the test workload image: one layer holding busybox-static and its
  applets (the pause container's process is ``sleep``, which waits until the runtime
  kills it, as pause does), written here as ``docker save`` archives;
- the flannelpy image: built from ``manifests/Dockerfile`` by ``scripts/build-images.sh``
  on a Debian 12 base made locally, cached outside git keyed by a hash of its inputs.

Each archive is imported into every node's containerd with ``ctr images import``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass

from flannelpy_lab.errors import LabError
from flannelpy_lab.flanneld import repo_root

IMAGES_DIR_ENV = "FLANNELPY_IMAGES_DIR"
IMAGE_ARCHIVE_ENV = "FLANNELPY_IMAGE_ARCHIVE"  # an image of one's own instead of the build
DEFAULT_IMAGES_DIR = "/var/cache/flannelpy/images"
BUILD_SCRIPT = "scripts/build-images.sh"
BUILD_TIMEOUT = 1800.0  # seconds: a first build from an empty cache (debootstrap, pip)
PAUSE_IMAGE = "localhost/flannelpy-pause:1"
BUSYBOX_IMAGE = "localhost/flannelpy-busybox:1"
PAUSE_ENTRYPOINT = ("/bin/sleep", "2147483647")
BUSYBOX = "/bin/busybox"  # from busybox-static: the rootfs needs no libc
# The Service tests' backends (httpd running a CGI) and clients (wget under timeout:
# busybox-static's wget crashes on its own -T).
SERVICE_APPLETS = ("httpd", "mkdir", "chmod", "timeout")
BASIC_APPLETS = ("sh", "ping", "nc", "sleep", "cat", "ip", "hostname", "wget", "ls", "echo")
APPLETS = BASIC_APPLETS + SERVICE_APPLETS
MISSING_TOOLS_HINT = "run scripts/bootstrap.sh, which installs busybox-static"


@dataclass(frozen=True)
class Image:
    """An image reference and the archive holding it."""

    ref: str
    archive: str


def images_dir() -> str:
    return os.environ.get(IMAGES_DIR_ENV, DEFAULT_IMAGES_DIR)


def _is_static_elf(path: str) -> bool:
    """An ELF file without a PT_INTERP program header (no dynamic loader needed)."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)
    except OSError:
        return False
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit only, as this host is
        return False
    phoff = int.from_bytes(data[32:40], "little")
    phentsize = int.from_bytes(data[54:56], "little")
    phnum = int.from_bytes(data[56:58], "little")
    for i in range(phnum):
        start = phoff + i * phentsize
        if int.from_bytes(data[start : start + 4], "little") == 3:  # PT_INTERP
            return False
    return True


def busybox_layer() -> bytes:
    """A layer tar: /bin/busybox and a symlink per applet, /etc/passwd, empty /tmp and /proc."""
    if not _is_static_elf(BUSYBOX):
        raise LabError(f"{BUSYBOX} is missing or not statically linked; {MISSING_TOOLS_HINT}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "run", "var"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(BUSYBOX, "bin/busybox")
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        passwd = b"root:x:0:0:root:/:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size, info.mode = len(passwd), 0o644
        tar.addfile(info, io.BytesIO(passwd))
    return buf.getvalue()


def layer_digest(layer: bytes) -> str:
    """A layer's content digest (hex), which also keys what is built from it."""
    return hashlib.sha256(layer).hexdigest()


def image_archive(tag: str, layer: bytes, entrypoint: Sequence[str]) -> bytes:
    """A ``docker save`` archive: one uncompressed layer, its config, manifest.json."""
    digest = "sha256:" + layer_digest(layer)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": list(entrypoint), "WorkingDir": "/", "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [digest]},
            "history": [{"created_by": "flannelpy lab (lab/flannelpy_lab/images.py)"}],
        },
        sort_keys=True,
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    layer_name = f"{digest.removeprefix('sha256:')}/layer.tar"
    manifest = json.dumps(
        [{"Config": config_name, "RepoTags": [tag], "Layers": [layer_name]}]
    ).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in ((config_name, config), (layer_name, layer), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def busybox_images(directory: str) -> list[Image]:
    """The pause and the test image as archives in ``directory`` (written each time: a
    few milliseconds)."""
    layer = busybox_layer()
    out = []
    for ref, entrypoint in ((PAUSE_IMAGE, PAUSE_ENTRYPOINT), (BUSYBOX_IMAGE, ("/bin/sh",))):
        path = os.path.join(directory, ref.split("/")[-1].replace(":", "-") + ".tar")
        with open(path + ".tmp", "wb") as f:
            f.write(image_archive(ref, layer, entrypoint))
        os.replace(path + ".tmp", path)
        out.append(Image(ref, path))
    return out


def archive_image(path: str) -> Image:
    """The image a ``docker save`` archive holds (its first tag)."""
    try:
        with tarfile.open(path) as tar:
            member = tar.extractfile("manifest.json")
            tags = json.load(member)[0]["RepoTags"] if member else []
    except (OSError, tarfile.TarError, KeyError, IndexError, ValueError) as e:
        raise LabError(
            f"{path} is not an image archive with a tag ({e}); give the output "
            "of `podman save --format docker-archive`"
        ) from e
    if not tags:
        raise LabError(f"{path} holds an untagged image; save it with a tag")
    return Image(str(tags[0]), path)


def flannelpy_image() -> Image:
    """The flannelpy image: the archive ``$FLANNELPY_IMAGE_ARCHIVE`` names, else from the
    build cache or built now by scripts/build-images.sh."""
    explicit = os.environ.get(IMAGE_ARCHIVE_ENV)
    if explicit:
        return archive_image(explicit)
    script = os.path.join(repo_root(), BUILD_SCRIPT)
    try:
        # The script's own lines (what it builds, about how long) reach the user on stderr.
        proc = subprocess.run(
            ["bash", script], stdout=subprocess.PIPE, text=True, timeout=BUILD_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise LabError(
            f"{BUILD_SCRIPT} did not finish within {BUILD_TIMEOUT:g} s; run it "
            "by hand to see where it stops"
        ) from e
    fields = proc.stdout.split()
    if proc.returncode != 0 or len(fields) != 2 or not os.path.isfile(fields[1]):
        raise LabError(
            f"{BUILD_SCRIPT} failed (exit {proc.returncode}, its output above); run it by hand"
        )
    return Image(fields[0], fields[1])


def import_image(socket_path: str, image: Image, timeout: float = 180.0) -> None:
    """``ctr images import`` into the Kubernetes namespace of one containerd."""
    argv = [
        "ctr",
        f"--address={socket_path}",
        "--namespace=k8s.io",
        "images",
        "import",
        image.archive,
    ]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise LabError(
            f"`ctr images import {image.archive}` did not finish within {timeout:g} s"
        ) from e
    if proc.returncode != 0:
        raise LabError(
            f"`ctr images import {image.archive}` failed: "
            f"{(proc.stderr or proc.stdout).strip()[-400:]}"
        )
