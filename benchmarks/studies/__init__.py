"""Learning studies and their statistics, tables and figures (benchmarks/README.md)."""
