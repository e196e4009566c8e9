"""Task sources owned by the broker: the training cursor and held-out set (source.py) over
a built-in team's synthetic tasks, local JSONL/Parquet files or your own function, and
`drmas data` conversion (convert.py). Grading belongs to each team (drmas/teams)."""
