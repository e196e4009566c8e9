"""Rollout actors (`drmas actor`): run leased groups through a workflow and stream the
episodes to the broker; receive new weights from each model's learner rank 0.

    main.py       the actor process (talks to the broker; joins weight groups)
    engines/      generation backends behind one interface (hf; vllm/sglang/sim to come)
    workflows/    multi-agent episodes (the math Solver <-> Verifier team)
"""
