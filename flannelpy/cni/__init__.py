"""The agent's side of CNI: the socket server, the command handler, pod plumbing, records.

``server.CniServer`` receives what the thin executable (``cni_plugin``) forwards,
``handler.CniHandler`` runs the command against ``flannelpy.ipam.NodeIpam``,
``podnet.PodNetwork`` (bridge and veth pairs) and ``records.RecordStore``.
"""

from flannelpy.cni.handler import CniHandler, CniSettings
from flannelpy.cni.records import Record, RecordStore
from flannelpy.cni.server import CniServer
from flannelpy.dataplane.podnet import PodLink, PodNetwork, host_veth_name

__all__ = [
    "CniHandler",
    "CniServer",
    "CniSettings",
    "PodLink",
    "PodNetwork",
    "Record",
    "RecordStore",
    "host_veth_name",
]
