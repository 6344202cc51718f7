"""A pids cgroup per sandboxed command: caps its process count, even for host root.

RLIMIT_NPROC is not enforced for processes whose real uid is host root, and bubblewrap run
by root maps the sandbox user to host root, so a fork bomb would only be stopped by the
wall-clock timeout after it had taken the host's pid space. A pids cgroup (`pids.max`)
bounds the whole sandbox whatever its uid. Used when the pids controller is writable
(cgroup v1 `pids` hierarchy, or cgroup v2 with `pids` delegated to our cgroup); absent
that, the sandbox says so (Isolation.notes) and relies on RLIMIT_NPROC.

The launcher joins the cgroup before exec'ing bubblewrap (`echo 0 > cgroup.procs`), so
every process of the sandbox is born inside it; afterwards the cgroup is emptied
(SIGKILL to what is left) and removed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

PARENT = "cadenza-sandbox"


@dataclass(frozen=True)
class PidsHierarchy:
    parent: Path  # our cgroup's `cadenza-sandbox` child; one leaf per command below it
    version: int  # 1 or 2


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of cgroup mounts, from /proc/self/mountinfo."""
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                out.append((fields[4], rfields[0], set(rfields[2].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """Our cgroup path per v1 controller, and under key "" for v2, from /proc/self/cgroup."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(exist_ok=True)
        probe = path / f"probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


@functools.cache
def find_pids_hierarchy() -> PidsHierarchy | None:
    """Where per-command pids cgroups can be made, or None when nowhere (checked once)."""
    own = _own_paths()
    mounts = _mounts()
    for point, fstype, opts in mounts:
        if fstype == "cgroup" and "pids" in opts and "pids" in own:
            parent = Path(point) / own["pids"].lstrip("/") / PARENT
            if _writable_dir(parent):
                return PidsHierarchy(parent, 1)
    for point, fstype, _ in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        base = Path(point) / own[""].lstrip("/")
        try:
            if "pids" not in (base / "cgroup.subtree_control").read_text().split():
                continue
            parent = base / PARENT
            if not _writable_dir(parent):
                continue
            # Children of `parent` get pids.max only when parent delegates the controller.
            (parent / "cgroup.subtree_control").write_text("+pids")
            return PidsHierarchy(parent, 2)
        except OSError:
            continue
    return None


def create(hierarchy: PidsHierarchy, max_pids: int) -> Path:
    """A fresh leaf cgroup allowing `max_pids` tasks (processes and threads)."""
    leaf = hierarchy.parent / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    leaf.mkdir()
    try:
        (leaf / "pids.max").write_text(str(max_pids))
    except OSError:
        leaf.rmdir()
        raise
    return leaf


def pids(leaf: Path) -> list[int]:
    try:
        return [int(p) for p in (leaf / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def destroy(leaf: Path, timeout: float = 2.0) -> bool:
    """Kill whatever is left in `leaf`, wait until it is empty, remove it.

    bwrap returns as soon as its command exits, while the kernel may still be tearing
    down the namespace's other processes; waiting here for an empty cgroup means that
    when a run returns, nothing it started is alive. False if it could not be removed.
    """
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while True:
        if (leaf / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (leaf / "cgroup.kill").write_text("1")
        for pid in pids(leaf):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            leaf.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
