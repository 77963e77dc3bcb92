"""A Kubernetes CRI v1 client (``runtime.v1.RuntimeService``) over gRPC, as the kubelet talks.

The messages come from ``cri_api_v1.binpb``: k8s.io/cri-api ``MODULE_VERSION``'s
``pkg/apis/runtime/v1/api.proto`` compiled to a descriptor set (regenerate with
``tests/support/cri_regen.py``, which says how). Message classes are built from it
at import, so no generated code has to match the installed protobuf.

    cri = CriClient("/path/containerd.sock")
    sandbox_id = cri.call("RunPodSandbox", cri.message("RunPodSandboxRequest", config=...))
"""

from __future__ import annotations

import os
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

MODULE_VERSION = "k8s.io/cri-api v0.34.13"
DESCRIPTOR_SET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cri_api_v1.binpb")
PACKAGE = "runtime.v1"
SERVICE = f"{PACKAGE}.RuntimeService"
CALL_TIMEOUT = 60.0


def _pool() -> descriptor_pool.DescriptorPool:
    with open(DESCRIPTOR_SET, "rb") as f:
        files = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    for proto in files.file:
        pool.Add(proto)
    return pool


POOL = _pool()


def message_class(name: str) -> Any:
    descriptor = POOL.FindMessageTypeByName(f"{PACKAGE}.{name}")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(POOL).GetPrototype(descriptor)  # protobuf < 4.22


class CriError(AssertionError):
    """A CRI call failed; the message names the call and carries the runtime's error."""


class CriClient:
    """The runtime service on ``socket_path`` (a unix socket)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._service = POOL.FindServiceByName(SERVICE)

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def message(type_name: str, /, **fields: Any) -> Any:
        return message_class(type_name)(**fields)

    def call(self, method: str, request: Any = None, timeout: float = CALL_TIMEOUT) -> Any:
        """``RuntimeService/<method>`` with ``request`` (default: an empty request)."""
        rpc = self._service.methods_by_name[method]
        response_class = message_class(rpc.output_type.name)
        if request is None:
            request = message_class(rpc.input_type.name)()
        stub = self.channel.unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_class.FromString,
        )
        try:
            return stub(request, timeout=timeout)
        except grpc.RpcError as e:
            raise CriError(f"CRI {method} failed: {e.code().name}: {e.details()}") from e

    def ready(self) -> bool:
        """Whether the runtime answers Status with RuntimeReady and NetworkReady both true
        (the kubelet starts pods only then; NetworkReady needs a loaded CNI config)."""
        try:
            status = self.call("Status", timeout=5).status
        except CriError:
            return False
        conditions = {c.type: c.status for c in status.conditions}
        return conditions.get("RuntimeReady") is True and conditions.get("NetworkReady") is True
