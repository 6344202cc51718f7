"""cadenza.sandbox: run commands in isolation (bubblewrap + rlimits + a pids cgroup).

    from cadenza.sandbox import run, Sandbox, Limits
    r = run(["python", "-c", "print(1)"], workspace, timeout=30)
    r.returncode, r.stdout, r.timed_out

No network, only the workspace writable (at its own absolute path), host files other than
the toolchain invisible, a clean environment, and limits on CPU, memory, processes, file
size, open files, output and wall-clock time. `isolation()` says what this machine can
isolate; running without bubblewrap needs `unsafe=True`. Host code touching a workspace
after sandboxed code wrote to it goes through `inside(workspace, path)` (no symlink
escapes). This package never imports torch.
"""

from cadenza.sandbox.bwrap import Isolation
from cadenza.sandbox.bwrap import probe as isolation
from cadenza.sandbox.limits import Limits
from cadenza.sandbox.paths import PathEscape, inside
from cadenza.sandbox.sandbox import (
    DegradedSandboxWarning,
    Sandbox,
    SandboxError,
    SandboxResult,
    SandboxUnavailable,
    UnsafeSandboxWarning,
    run,
)

__all__ = [
    "DegradedSandboxWarning",
    "Isolation",
    "Limits",
    "PathEscape",
    "Sandbox",
    "SandboxError",
    "SandboxResult",
    "SandboxUnavailable",
    "UnsafeSandboxWarning",
    "inside",
    "isolation",
    "run",
]
