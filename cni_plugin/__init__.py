"""The thin CNI executable: client.py in Python (the launcher), forwarder.c in C, and the
conflist. It forwards each call to the agent's socket; the spec, the framing's reference
(``flannelpy.cni.wire``) and all CNI logic live in ``flannelpy.cni``.

Standard library only, and nothing is imported here: the executable must start fast.
"""
