"""How processes reach each other.

- channel.py: ZeroMQ DEALER (actors, learners, `drmas status`) <-> broker ROUTER; typed
  messages from drmas.protocol.
- weights.py: learner rank 0 -> actors, new weights over a torch.distributed group.
"""
