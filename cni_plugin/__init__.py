"""The CNI side of flannelpy: the spec types (spec.py), the framing to the agent
(wire.py) and the thin executable (client.py in Python, forwarder.c in C).

Standard library only, and nothing is imported here: the executable must start fast.
"""
