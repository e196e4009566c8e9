"""Learner groups (`drmas learner`, one torchrun world per model): pull batch shards from
the broker, take FSDP2 optimizer steps, and publish the new weights to the actors.

    entry.py       the one start of a learner rank: its place in the group, threads, exit
    main.py        Learner: setup -> loop(pull shard, step, publish) -> cleanup
    trainer.py     FSDP2 model, optimizer, one step
    updates.py     a shard -> the step's optimizer updates; batching.py: -> micro-batches
    adapters.py    a LoRA base: frozen base, one adapter per agent, only adapters published
    loss.py        PPO clipped surrogate with dual clip and off-policy correction
    model_io.py    the model in (HF folder) and out (full tensors, HF folder)
    checkpoint.py  DCP save/load of the group's model, optimizer and RNG state
    probe.py       Lemma 4.2 measured with the learner's own loss (`drmas probe`)
"""
