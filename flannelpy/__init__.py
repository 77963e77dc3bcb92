"""flannelpy: a node-level overlay network agent for Kubernetes, compatible with Flannel."""

__version__ = "0.1.0"
