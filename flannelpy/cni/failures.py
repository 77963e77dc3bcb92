"""Our failures as the CNI spec's errors: which exception becomes which error code.

A command wraps its work in :func:`cni_errors`; anything it does not map passes through,
and :meth:`flannelpy.cni.handler.CniHandler.handle` reports it as code 999.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from flannelpy.cni.spec import CniError, Code
from flannelpy.dataplane.podnet import NetnsMissing, PodInterfaceExists
from flannelpy.errors import ConfigError, DataplaneError, StoreError
from flannelpy.ipam.errors import IpamExhausted


@contextmanager
def cni_errors() -> Iterator[None]:
    """Turn our failures into spec errors; anything unexpected passes through (handle()
    reports it as code 999 and logs the traceback)."""
    try:
        yield
    except CniError:
        raise
    except Exception as e:
        mapped = _as_cni_error(e)
        if mapped is None:
            raise
        raise mapped from e


def _as_cni_error(e: BaseException) -> CniError | None:
    if isinstance(e, IpamExhausted):
        if e.accounting:
            hint = "ipWaitSeconds in the network config lets ADD wait for a cooling address"
        else:  # nothing to wait for: no lease of this node takes new pods
            hint = (
                "the agent's log says why it holds no lease that takes new pods "
                "(e.g. every pool is drained or full: flannelpy pools list)"
            )
        return CniError(Code.NO_ADDRESS, str(e), hint)
    if isinstance(e, NetnsMissing | PodInterfaceExists):
        return CniError(Code.INVALID_ENVIRONMENT, str(e))
    if isinstance(e, ConfigError):
        return CniError(Code.INVALID_NETWORK_CONFIG, str(e))
    if isinstance(e, StoreError):
        return CniError(Code.IO_FAILURE, f"the node's IPAM state cannot be used: {e}")
    if isinstance(e, OSError):
        return CniError(Code.IO_FAILURE, f"the flannelpy agent cannot write its state: {e}")
    if isinstance(e, DataplaneError):
        return CniError(Code.INTERNAL, str(e))
    return None
