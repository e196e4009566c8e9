"""How processes reach each other.

- channel.py: ZeroMQ DEALER (actors, learners, `drmas status`) <-> broker ROUTER; typed
  messages from drmas.protocol.
- security.py: CURVE keys of the broker socket (made, loaded, checked).
- weights/: learner rank 0 -> actors, new weights over a torch.distributed group.
- digest.py: a fingerprint of weights, so both ends can tell they hold the same version.
- ports.py: the one free-port picker.
"""
