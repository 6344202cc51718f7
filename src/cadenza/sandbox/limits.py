"""Resource limits of one sandboxed command, and their translation to POSIX rlimits.

rlimits are per process (CPU seconds, address space, file size, open files) except
RLIMIT_NPROC, which counts the processes of the real user; that count is not enforced
for host root, so the sandbox adds pids and memory cgroups where it can (cgroup.py).
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What one command may use. Sizes in MiB; `cpu_seconds=None` means timeout + 1 s."""

    cpu_seconds: float | None = None
    memory_mb: int = 4096  # address space of each process (RLIMIT_AS)
    # RAM of the whole sandbox, tmpfs included (memory cgroup); None: memory + tmp + shm
    total_memory_mb: int | None = None
    processes: int = 256  # processes and threads of the whole sandbox
    file_size_mb: int = 1024  # largest file a process may write (RLIMIT_FSIZE)
    disk_mb: int = 4096  # all that one command writes to the workspace (disk.py)
    open_files: int = 1024
    cpus: float | None = None  # CPU cores the whole sandbox may use (cgroup quota); None: all
    output_bytes: int = MiB  # captured stdout and stderr, each; the rest is dropped
    tmp_mb: int = 512  # private /tmp (tmpfs, counts against memory)
    shm_mb: int = 64  # private /dev/shm

    def __post_init__(self) -> None:
        for name in (
            "memory_mb",
            "processes",
            "file_size_mb",
            "disk_mb",
            "open_files",
            "tmp_mb",
            "shm_mb",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Limits.{name}: expected a positive int, found {value!r}")
        if self.total_memory_mb is not None and self.total_memory_mb <= 0:
            raise ValueError(
                f"Limits.total_memory_mb: expected > 0 or None, found {self.total_memory_mb!r}"
            )
        if self.output_bytes < 0:
            raise ValueError(f"Limits.output_bytes: expected >= 0, found {self.output_bytes!r}")
        if self.cpus is not None and self.cpus <= 0:
            raise ValueError(f"Limits.cpus: expected > 0 or None, found {self.cpus!r}")
        if self.cpu_seconds is not None and self.cpu_seconds <= 0:
            raise ValueError(f"Limits.cpu_seconds: expected > 0 or None, found {self.cpu_seconds}")


def cgroup_limits(limits: Limits) -> dict[str, int]:
    """Whole-sandbox limits for cgroup.create: task count, memory bytes."""
    total = limits.total_memory_mb or limits.memory_mb + limits.tmp_mb + limits.shm_mb
    out = {"pids": limits.processes, "memory": total * MiB}
    if limits.cpus is not None:
        out["cpu"] = max(1000, round(limits.cpus * 100_000))  # per 100 ms period
    return out


def rlimits(limits: Limits, timeout: float) -> dict[str, tuple[int, int]]:
    """(soft, hard) per resource name of prlimit(1).

    CPU: the soft limit sends SIGXCPU, the hard one (1 s later) SIGKILL, so a process that
    catches SIGXCPU still ends. Core dumps are off: they would land in the workspace.
    """
    cpu = limits.cpu_seconds if limits.cpu_seconds is not None else timeout + 1
    cpu_s = max(1, math.ceil(cpu))
    return {
        "cpu": (cpu_s, cpu_s + 1),
        "as": (limits.memory_mb * MiB,) * 2,
        "nproc": (limits.processes,) * 2,
        "fsize": (limits.file_size_mb * MiB,) * 2,
        "nofile": (limits.open_files,) * 2,
        "core": (0, 0),
    }


def prlimit_argv(prlimit: str, limits: dict[str, tuple[int, int]]) -> list[str]:
    """`prlimit --cpu=S:H ... --`: sets the limits, then execs the rest of the argv."""
    return [prlimit, *(f"--{name}={soft}:{hard}" for name, (soft, hard) in limits.items()), "--"]


RLIMIT = {
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "core": resource.RLIMIT_CORE,
}


def apply_rlimits(limits: dict[str, tuple[int, int]]) -> None:
    """Set the limits on the calling process (the fallback when prlimit(1) is missing)."""
    for name, value in limits.items():
        resource.setrlimit(RLIMIT[name], value)
