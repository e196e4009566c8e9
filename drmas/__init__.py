"""drmas: asynchronous actor-learner RL for multi-agent LLM workflows (Dr. MAS)."""

__version__ = "0.1.0"
