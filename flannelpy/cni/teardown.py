"""Taking attachments down: CNI DEL and GC, and the clean-up at agent start.

DEL is best effort and idempotent, and reads the record, not the current config: veth
(by its host end), address (into cooldown), record. A missing namespace, link, address
or record is success. DEL never needs the pod's namespace when there is a record: it
deletes the veth by its host end. In the agent the address and the record go after the
reply, under the attachment's lock (``defer``); the start-up GC covers a crash between.

GC (the runtime's, and :meth:`TeardownCommands.gc_dead` at start) forgets attachments
the runtime no longer lists or whose pod is gone, and releases addresses no record
explains.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flannelpy.cni import netconf
from flannelpy.cni.context import CommandContext, Deferred, Key
from flannelpy.cni.failures import cni_errors
from flannelpy.cni.records import Record
from flannelpy.cni.spec import Request
from flannelpy.dataplane.podnet import veth_owner
from flannelpy.errors import DataplaneError, StoreError

# The handler's logger: these lines are the CNI handler's, as before the split.
log = logging.getLogger("flannelpy.cni.handler")


class TeardownCommands(CommandContext):
    def delete(
        self, req: Request, netns_fd: int | None = None, defer: Deferred | None = None
    ) -> None:
        """DEL; ``netns_fd`` (the pod's namespace, if it could be opened) is only needed
        when there is no record to find the veth by.

        With ``defer``, DEL returns once the veth is gone and appends the rest (the
        address into cooldown, the record removed) to ``defer``, still holding the
        attachment's lock: the caller runs it after the reply, so the runtime does not
        wait for IPAM's pool file, and no request for the same attachment can run in
        between. A crash before it runs leaves the record and the allocation, the veth
        gone: the start-up GC (``gc_dead``) releases them."""
        key = (req.container_id, req.ifname)
        release_lock = self.locks.acquire(key)
        try:
            record = self.records.read(req.network_name, *key)
            with cni_errors():
                if record is not None:  # answered once the pair has left both namespaces
                    owner = record_owner(record)
                    veth_answer = self.pods.start_delete_host_veth(record.host_veth, owner)
                else:
                    pod_ns = (req.netns, netns_fd) if netns_fd is not None else None
                    self._remove_veth(None, pod_ns, req.ifname)
                    veth_answer = _nothing
        except BaseException:
            release_lock()
            raise

        def finish() -> None:
            try:
                with cni_errors():
                    veth_answer()  # the kernel's answer: the address outlives the veth
                    self.ipam.release(*key)
                    self.records.delete(req.network_name, *key)
            finally:
                release_lock()

        if defer is None:
            finish()
        else:
            defer.append(finish)

    def _teardown(
        self,
        record: Record | None,
        pod_ns: tuple[str, int] | None,
        container_id: str,
        ifname: str,
    ) -> None:
        """Veth first, then the address: an address is never free while a veth holds it.
        ``pod_ns``: (CNI_NETNS, its fd), to look inside when there is no record."""
        self._remove_veth(record, pod_ns, ifname)
        self.ipam.release(container_id, ifname)

    def _remove_veth(
        self, record: Record | None, pod_ns: tuple[str, int] | None, ifname: str
    ) -> None:
        if record is not None:
            self.pods.delete_host_veth(record.host_veth, record_owner(record))
        elif pod_ns is not None:
            self.pods.delete_in_netns(pod_ns[0], ifname, netns_fd=pod_ns[1])

    def gc(self, req: Request) -> None:
        """CNI GC: drop every attachment of this network the runtime no longer lists."""
        valid = netconf.valid_attachments(req.config)
        for record in self.records.list(req.network_name):
            key = (record.container_id, record.ifname)
            if key not in valid:
                self._forget(record.network, key)
        for alloc in self.ipam.allocations():
            key = (alloc.container_id, alloc.ifname)
            if key not in valid:
                self._release_orphan(key)

    def gc_dead(self, exists: Callable[[str], bool] | None = None) -> list[Key]:
        """At agent start: forget attachments whose pod is gone, and release
        addresses no record explains (an ADD that died half-way). Run it before
        the server accepts requests. Returns the keys released.

        A pod is gone when its host veth is: the kernel deletes a veth pair with
        the namespace holding one end. Its CNI_NETNS path tells nothing, because
        the agent need not see the runtime's mounts. ``exists(netns)`` replaces
        that test (unit tests without a kernel)."""
        released: list[Key] = []
        for path, why in self.records.unreadable():
            # Its pod may be alive: releasing would hand its address out twice.
            log.error(
                "CNI record unreadable, its address is kept until a DEL path=%s reason=%s;"
                " restore or remove the file once the pod is known to be gone",
                path,
                why,
            )
        for record in self.records.list():
            alive = (
                exists(record.netns)
                if exists is not None
                else self.pods.link(record.host_veth) is not None
            )
            if not alive:
                key = (record.container_id, record.ifname)
                if self._forget(record.network, key):
                    released.append(key)
        for alloc in self.ipam.allocations():
            key = (alloc.container_id, alloc.ifname)
            if self._release_orphan(key):
                released.append(key)
        if released:
            log.info("released addresses of gone pods count=%d", len(released))
        return released

    def _forget(self, network: str, key: Key) -> bool:
        with self.locks.hold(key):
            record = self.records.read(network, *key)
            if record is None:
                return False
            try:
                self._teardown(record, None, *key)
            except (DataplaneError, StoreError, OSError) as e:
                log.warning("GC could not remove an attachment key=%s reason=%s", key, e)
                return False
            self.records.delete(network, *key)
            return True

    def _release_orphan(self, key: Key) -> bool:
        """Release ``key``'s address if no network has a record for it (checked under
        the key's lock, so an ADD in flight is waited for, then seen)."""
        with self.locks.hold(key):
            # present, not read: an unreadable record still holds its address.
            if any(self.records.present(n, *key) for n in self.records.networks()):
                return False
            return self.ipam.release(*key) is not None


def _nothing() -> None:
    """No kernel answer to wait for."""


def record_owner(record: Record) -> str:
    """The alias ADD gave the record's host veth: a delete spares any other pod's."""
    return veth_owner(record.netns, record.container_id, record.ifname)
