"""Sandbox config: how agent tools and graders run commands (see cadenza.sandbox)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SandboxConfig:
    """Limits per command; `unsafe=True` runs WITHOUT isolation (explicit opt-in only)."""

    timeout: float = 60.0  # wall-clock seconds; the whole process tree is killed after
    memory_mb: int = 4096  # address space per process
    cpu_seconds: float | None = None  # None: timeout + 1
    processes: int = 256  # processes and threads of one sandbox
    file_size_mb: int = 1024
    disk_mb: int = 4096  # all one command writes to the workspace
    open_files: int = 1024
    cpus: float | None = None  # CPU cores one sandbox may use; None: no cap
    output_bytes: int = 1 << 20  # per stream; the rest is dropped and flagged
    tmp_mb: int = 512  # private /tmp
    unsafe: bool = False
