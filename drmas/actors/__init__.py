"""Rollout actors (`drmas actor`): run leased groups through the team's workflow and
stream the episodes to the broker; receive new weights from each model's learner rank 0.

    main.py       the actor process (talks to the broker; pauses engines for weight joins)
    loading.py    a weight publish received into an in-process engine (hf, sim)
    failures.py   the team's own code failing: reports, giving up
    timebook.py   where the actor's wall time goes (generating, waiting, loading)
    engines/      generation backends behind one interface: hf, vllm, sglang, sim
"""
