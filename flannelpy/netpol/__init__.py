"""NetworkPolicy, compiled in pure code: API objects -> per-node nftables values.

``model`` parses ``networking.k8s.io/v1`` NetworkPolicies, Pods and Namespaces
(untrusted JSON) into frozen values and refuses what cannot be represented;
``compile`` turns all of them and a node name into that node's desired policy
state; ``nft`` renders it as a table and diffs two of them into one atomic,
proportional nftables transaction. Nothing here touches the kernel or the API.
"""
