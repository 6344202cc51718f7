"""How much a command may write to the workspace's disk, across all its files.

RLIMIT_FSIZE caps one file; a command can still fill the host disk with many files under
that size. The workspace is a host directory (no quota of its own), so the runner
watches: every half second it compares the filesystem's free space with the start of the
run (one statvfs call); only when that has dropped by more than the limit does it walk
the workspace to total what this run wrote (files modified since the start), so another
process filling the same disk is not blamed on the sandbox. Over the limit: the sandbox
is killed (`killed_by="disk"`). Overshoot is what the command writes in one interval.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def written_since(root: Path, since: float) -> int:
    """Bytes on disk of files under `root` modified at or after `since` (no symlinks)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if st.st_mtime >= since:
                total += st.st_blocks * 512
    return total


class DiskWatch:
    """`check()` returns "disk" once the run has written more than `limit_bytes`."""

    def __init__(self, workspace: Path, limit_bytes: int) -> None:
        self.workspace = workspace
        self.limit = limit_bytes
        self.since = time.time() - 1.0  # mtime granularity and clock skew
        self.free0 = _free(workspace)

    def check(self) -> str | None:
        try:
            if self.free0 - _free(self.workspace) <= self.limit:
                return None
        except OSError:
            return None
        return "disk" if written_since(self.workspace, self.since) > self.limit else None
