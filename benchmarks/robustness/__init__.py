"""Hostile clients against the broker, alone and beside whole runs (benchmarks/README.md)."""
