"""Speed, memory and scale benchmarks (benchmarks/README.md)."""
