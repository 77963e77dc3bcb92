"""Where the cluster's state lives: etcd or the Kubernetes API, and nothing else.

Only this package talks to either. ``open_store`` chooses once and returns one face
(``ClusterStore``); the rollout's store (``rollout_etcd``, ``rollout_kube``), the node
control channel (``node_control``) and the policy records implement the protocols the
layers below declare.
"""
