"""Benchmarks and GPU checks (run on the GPU machine; never timed in tests)."""
