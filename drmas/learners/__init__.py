"""Learner groups (`drmas learner`, one torchrun world per model): pull batch shards from
the broker, take FSDP2 optimizer steps, and publish the new weights to the actors.

    main.py       setup -> loop(pull shard, step, publish) -> cleanup
    trainer.py    FSDP2 model, optimizer, one step; batching.py: shards -> micro-batches
    loss.py       PPO clipped surrogate with dual clip and off-policy correction
"""
