"""CNI commands in the agent: ADD, DEL, CHECK, GC, STATUS, VERSION.

Every request ends as ``(exit code, stdout)``: a result or nothing with 0, the
spec's error JSON with 1. Nothing else escapes :meth:`CniHandler.handle`.

The commands live in modules of their own, combined here into :class:`CniHandler`:
ADD in :mod:`flannelpy.cni.add`, DEL and GC in :mod:`flannelpy.cni.teardown`, CHECK in
:mod:`flannelpy.cni.check`; the state they share and the lock per attachment in
:mod:`flannelpy.cni.context`, the network config keys in :mod:`flannelpy.cni.netconf`,
the mapping of our failures to the spec's codes in :mod:`flannelpy.cni.failures`.

The pod's network namespace: ``CNI_NETNS`` is the identity (records, veth
names, results), and every access goes through an open descriptor. The
executable opens the path in the runtime's mount namespace and passes the
descriptor (:mod:`flannelpy.cni.server`); the path itself may name nothing, or
an empty file, in the agent's (containerd's state-dir mounts, /proc/<pid>/ns/net
of another PID namespace). Whatever arrives is verified to be a network
namespace first. Without a descriptor (an executable from before, or one that
could not open the path) the agent opens the path itself. DEL never needs the
namespace: it deletes the veth by its host end, from the record.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from flannelpy.cni.add import AddCommand
from flannelpy.cni.check import CheckCommand
from flannelpy.cni.context import CniSettings, Deferred, KeyLocks
from flannelpy.cni.records import RecordStore
from flannelpy.cni.spec import CniError, Code, Request, parse_request, reply_version, version_reply
from flannelpy.cni.teardown import TeardownCommands
from flannelpy.cni.workers import Workers
from flannelpy.dataplane.netns import NotANetns, require_netns_fd
from flannelpy.dataplane.podnet import PodNetwork
from flannelpy.ipam import NodeIpam

log = logging.getLogger(__name__)


def open_netns_path(path: str) -> int:
    """CNI_NETNS opened by the agent itself (an executable that passed no fd).
    O_NONBLOCK: a FIFO there must not hang a worker (no effect on a namespace)."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)


class CniHandler(AddCommand, TeardownCommands, CheckCommand):
    """Every CNI command behind one entry point, :meth:`handle`."""

    def __init__(
        self,
        ipam: NodeIpam,
        pods: PodNetwork,
        records: RecordStore,
        settings: CniSettings,
        open_netns: Callable[[str], int] = open_netns_path,
        require_netns: Callable[[int], None] = require_netns_fd,
    ) -> None:
        self.ipam = ipam
        self.pods = pods
        self.records = records
        self.settings = settings
        self.open_netns = open_netns  # a path -> an fd the handler closes; raises OSError
        self.require_netns = require_netns  # raises NotANetns unless the fd is a netns
        self.locks = KeyLocks()
        self.writers = Workers("cni-record")

    # -- entry point

    def handle(
        self,
        env: Mapping[str, str],
        stdin: bytes,
        netns_fd: int | None = None,
        defer: Deferred | None = None,
    ) -> tuple[int, bytes]:
        """One request. ``netns_fd``: CNI_NETNS as the executable opened it, or None;
        the caller keeps it and closes it afterwards. ``defer``: a list that gets what
        a successful DEL leaves for after the reply (its release, holding the
        attachment's lock), which the caller must then run; None: DEL does it all."""
        version = reply_version(stdin)
        try:
            req = parse_request(env, stdin)
            version = req.cni_version
            return 0, self._dispatch(req, netns_fd, defer)
        except CniError as e:
            log.info(
                "CNI request refused command=%s code=%s msg=%s",
                env.get("CNI_COMMAND"),
                e.code,
                e.msg,
            )
            return 1, e.to_json(version)
        except Exception as e:
            log.exception("CNI request failed command=%s", env.get("CNI_COMMAND"))
            err = CniError(Code.INTERNAL, f"the flannelpy agent failed unexpectedly: {e}")
            return 1, err.to_json(version)

    def _dispatch(
        self, req: Request, netns_fd: int | None = None, defer: Deferred | None = None
    ) -> bytes:
        command = req.command
        if command == "ADD":
            with self._pod_netns(req, netns_fd) as fd:
                return self.add(req, fd)
        if command == "DEL":
            with self._pod_netns(req, netns_fd, required=False) as maybe_fd:
                self.delete(req, maybe_fd, defer)
            return b""
        if command == "CHECK":
            with self._pod_netns(req, netns_fd) as fd:
                self.check(req, fd)
            return b""
        if command == "GC":
            self.gc(req)
            return b""
        if command == "STATUS":
            self.status()
            return b""
        if command == "VERSION":
            return version_reply(req.cni_version)
        raise CniError(Code.INVALID_ENVIRONMENT, f"unknown CNI_COMMAND {command!r}")

    # -- STATUS

    def status(self) -> None:
        if not self.settings.ready():
            raise CniError(
                Code.NOT_AVAILABLE,
                "the flannelpy agent is not ready: it has no subnet lease or its data plane"
                " is not programmed yet",
            )

    # -- the pod's namespace

    @contextmanager
    def _pod_netns(
        self, req: Request, netns_fd: int | None, required: bool = True
    ) -> Iterator[int | None]:
        """CNI_NETNS as an fd verified to be a network namespace: the one passed, else
        the path opened here (and closed after). Refusals are code 4, "invalid
        necessary environment variables" (CNI spec, "Error codes"): CNI_NETNS names
        no network namespace. Not ``required`` (DEL): None instead of an error."""
        opened = None  # the fd opened here from the path, closed on the way out
        if netns_fd is None and req.netns:
            try:
                opened = self.open_netns(req.netns)
            except OSError as e:
                if not required:
                    yield None
                    return
                raise CniError(
                    Code.INVALID_ENVIRONMENT,
                    f"CNI_NETNS {req.netns} cannot be opened ({e.strerror}); pass the path of"
                    " the container's network namespace",
                ) from e
        fd = netns_fd if netns_fd is not None else opened
        try:
            if fd is not None:
                try:
                    self.require_netns(fd)
                except NotANetns as e:
                    if required:
                        why = _not_a_netns(req, e, opened)
                        raise CniError(Code.INVALID_ENVIRONMENT, why) from e
                    fd = None
            yield fd  # None: DEL without a usable CNI_NETNS (parse_request demands it elsewhere)
        finally:
            if opened is not None:
                os.close(opened)


def _not_a_netns(req: Request, error: Exception, opened: int | None) -> str:
    if opened is None:  # the executable passed it
        return (
            f"CNI_NETNS {req.netns} is not a network namespace ({error}); pass the path of the"
            " container's network namespace"
        )
    # An executable that predates passing the fd, in a mount namespace the agent does
    # not share: the path shows the agent something else.
    return (
        f"CNI_NETNS {req.netns} is not a network namespace where the flannelpy agent looks"
        f" ({error}); install the current flannelpy-cni on this node (it passes the namespace"
        " itself) or mount the runtime's namespace directory into the agent"
    )
