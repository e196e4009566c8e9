"""Task sources owned by the broker (synthetic arithmetic, local JSONL/Parquet) and the
grading the actors apply (math-verify)."""
