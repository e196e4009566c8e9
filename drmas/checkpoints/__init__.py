"""Checkpoints of a run: learners' sharded model/optimizer state and the broker's state.

Written by learner ranks and the broker every `checkpoint.every` steps (and at the end),
read back by `drmas train run.resume=RUN_DIR` (and the per-role commands).

    store.py          folders on disk: manifest written last, atomic rename, keep-N rotation
    tensors.py        one rank's files: safetensors + JSON, read back without pickle
    (drmas/learners/checkpoint.py: save/load of one learner group's shards, in these folders)
    (drmas/broker/checkpoint.py: the broker's snapshot/restore, broker.json in the root)
"""
