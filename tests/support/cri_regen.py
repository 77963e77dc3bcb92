"""Regenerate tests/support/cri_api_v1.binpb, the CRI v1 API that tests/support/cri_api.py loads.

The file is the serialized ``FileDescriptorSet`` of k8s.io/cri-api's
``pkg/apis/runtime/v1/api.proto`` (package ``runtime.v1``, the API containerd
1.6 serves), compiled by grpcio-tools' protoc. A descriptor rather than
generated ``_pb2`` modules: generated code checks the protobuf runtime's major
version against the generator's (and warns or fails when they differ), while a
descriptor loads on any protobuf the project allows.

    python3 -m venv /tmp/grpc-tools && /tmp/grpc-tools/bin/pip install grpcio-tools
    /tmp/grpc-tools/bin/python tests/support/cri_regen.py [k8s.io/cri-api version]

The module comes from the Go module proxy (``go mod download``); pass a newer
version to move, and update ``MODULE_VERSION`` in cri_api.py with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from grpc_tools import protoc  # type: ignore[import-untyped]

DEFAULT_VERSION = "v0.34.13"
PROTO_DIR = "pkg/apis/runtime/v1"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cri_api_v1.binpb")


def module_dir(version: str) -> str:
    with tempfile.TemporaryDirectory() as scratch:  # outside any Go module
        out = subprocess.run(
            ["go", "mod", "download", "-json", f"k8s.io/cri-api@{version}"],
            cwd=scratch,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return str(json.loads(out)["Dir"])


def main() -> int:
    version = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_VERSION
    include = os.path.join(module_dir(version), PROTO_DIR)
    code = protoc.main(
        [
            "protoc",
            f"-I{include}",
            f"--descriptor_set_out={OUT}",
            os.path.join(include, "api.proto"),
        ]
    )
    if code == 0:
        print(f"wrote {OUT} from k8s.io/cri-api@{version}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
