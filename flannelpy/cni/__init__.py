"""CNI, in one home: the spec (``spec``: validation, results, error JSON), the framing the
executable speaks (``wire``), the socket server, the command handler, the records, and the
agent's pod side (``pods.PodAttachments``: node IPAM, the bridge, the server, and the
listeners told of each pod that comes and goes).

``server.CniServer`` receives what the thin executable (``cni_plugin``) forwards,
``handler.CniHandler`` runs the command (ADD in ``add``, DEL and GC in ``teardown``, CHECK
in ``check``) against ``flannelpy.ipam.NodeIpam``, ``podnet.PodNetwork`` (bridge and veth
pairs) and ``records.RecordStore``.
"""

from flannelpy.cni.context import CniSettings
from flannelpy.cni.handler import CniHandler
from flannelpy.cni.records import Record, RecordStore
from flannelpy.cni.server import CniServer
from flannelpy.dataplane.podnames import host_veth_name
from flannelpy.dataplane.podnet import PodLink, PodNetwork

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
