"""Tests run distributed code through cadenza.parallel.spawn (N gloo processes, FileStore in a
temporary directory, exceptions propagated, hard timeout)."""

from cadenza.parallel.spawn import DistributedRunError, run_distributed

DistributedTestError = DistributedRunError

__all__ = ["DistributedRunError", "DistributedTestError", "run_distributed"]
