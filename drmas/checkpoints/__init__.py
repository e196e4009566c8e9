"""Checkpoints of a run: learners' sharded model/optimizer state and the broker's state.

Written by learner ranks and the broker every `checkpoint.every` steps, read back by
`drmas train run.resume=RUN_DIR` (and the per-role commands).
"""
