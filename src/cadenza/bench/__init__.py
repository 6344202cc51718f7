"""Benchmarks: each module has `run(argv: list[str]) -> dict` and prints ratio vs baseline."""
