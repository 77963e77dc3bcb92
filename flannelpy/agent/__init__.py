"""The node agent.

- ``compose``: builds every adapter (the one etcd/Kubernetes choice, via
  ``store.open_store``); ``run_agent`` is the ``flannelpy agent`` command's body.
- ``node``: ``NodeAgent``, the lifecycle: start order, supervised threads, shutdown.
- ``writer``: the one thread that changes the node's state, fed by ``events``;
  ``state`` holds that state and the immutable view other threads read.
- The concerns the writer calls: ``leases`` (our own leases), ``planning``
  (leases -> kernel plan), ``capacity`` (pools, IPAM, warm capacity),
  ``live_config`` (config changes under the disruption policy), ``firewall``,
  ``status`` (status.json, the store record, readiness, subnet.env), ``pods``
  (the CNI side) and ``vtep``.
"""
