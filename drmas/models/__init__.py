"""Model checkpoints: resolve `models.<m>.path` to a Hugging Face folder; builtin models
(builtin.py) are created, warm-started and cached on first use."""
