"""Per-command cgroups: cap the sandbox's process count and its total memory.

rlimits are per process (and RLIMIT_NPROC is not enforced when the runner is host root,
to which bubblewrap maps the sandbox user), so a fork bomb, or many processes each just
under the address-space limit, or files piled into the private tmpfs, could still take
the host down. A cgroup bounds the sandbox as a whole:

    pids    pids.max = Limits.processes (processes and threads)
    cpu     a CFS quota of Limits.cpus cores (when set), so one sandbox cannot take
            every core of a shared machine until its timeout
    memory  memory.limit_in_bytes (v1) / memory.max (v2) = Limits.total_memory_mb, which
            also counts the sandbox's tmpfs pages; over it the kernel's OOM killer
            ends a process of this sandbox only

Used where the controller is writable: a cgroup v1 hierarchy of that controller, or
cgroup v2 with the controller delegated to our cgroup. Where not, the sandbox says so
(Isolation.notes). The runner moves the sandbox's parked pid 1 into the leaves before
it runs anything; afterwards the leaves are emptied (SIGKILL) and removed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

PARENT = "cadenza-sandbox"
CONTROLLERS = ("pids", "memory", "cpu")


@dataclass(frozen=True)
class Hierarchy:
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


def _sweep(parent: Path) -> None:
    """Remove leaves left by runners that died (named after their pid): empty ones only."""
    with contextlib.suppress(OSError):
        for leaf in parent.iterdir():
            owner = leaf.name.split("-", 1)[0]
            if leaf.is_dir() and owner.isdigit() and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(OSError):
                    leaf.rmdir()


@functools.cache
def find_hierarchy(controller: str) -> Hierarchy | None:
    """Where per-command cgroups with `controller` can be made; None if nowhere (cached)."""
    own = _own_paths()
    mounts = _mounts()
    for point, fstype, opts in mounts:
        if fstype == "cgroup" and controller in opts and controller in own:
            parent = Path(point) / own[controller].lstrip("/") / PARENT
            if _writable_dir(parent):
                _sweep(parent)
                return Hierarchy(parent, 1)
    for point, fstype, _ in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        base = Path(point) / own[""].lstrip("/")
        try:
            if controller not in (base / "cgroup.subtree_control").read_text().split():
                continue
            parent = base / PARENT
            if not _writable_dir(parent):
                continue
            # Leaves under `parent` get the controller only when parent delegates it.
            (parent / "cgroup.subtree_control").write_text(f"+{controller}")
            _sweep(parent)
            return Hierarchy(parent, 2)
        except OSError:
            continue
    return None


CPU_PERIOD_US = 100_000


def _settings(controller: str, version: int, value: int) -> dict[str, str]:
    if controller == "pids":
        return {"pids.max": str(value)}
    if controller == "cpu":  # value: microseconds of CPU per 100 ms period
        if version == 1:
            return {"cpu.cfs_period_us": str(CPU_PERIOD_US), "cpu.cfs_quota_us": str(value)}
        return {"cpu.max": f"{value} {CPU_PERIOD_US}"}
    if version == 1:
        # memsw (memory + swap) where the kernel accounts swap, so swap is no way around.
        return {"memory.limit_in_bytes": str(value), "memory.memsw.limit_in_bytes": str(value)}
    return {"memory.max": str(value), "memory.swap.max": "0"}


@dataclass
class Leaves:
    """The cgroups of one command: one leaf per hierarchy (v1: per controller)."""

    paths: list[Path] = field(default_factory=list)
    memory: Path | None = None

    def enrol(self, pid: int) -> None:
        for leaf in self.paths:
            (leaf / "cgroup.procs").write_text(str(pid))

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer ended a process of this sandbox."""
        if self.memory is None:
            return False
        for name in ("memory.oom_control", "memory.events"):
            with contextlib.suppress(OSError, ValueError):
                for line in (self.memory / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
        return False

    def destroy(self, timeout: float = 2.0) -> bool:
        ok = True
        for leaf in self.paths:
            ok &= destroy(leaf, timeout)
        return ok


def create(limits: dict[str, int]) -> tuple[Leaves, list[str]]:
    """Leaves enforcing `limits` ({"pids": n, "memory": bytes, "cpu": quota_us}) where
    possible.

    Returns the leaves and, for each controller that could not be set up, a note.
    """
    leaves = Leaves()
    notes = []
    by_parent: dict[Path, tuple[Hierarchy, dict[str, str], list[str]]] = {}
    for controller, value in limits.items():
        h = find_hierarchy(controller)
        if h is None:
            notes.append(f"no writable {controller} cgroup")
            continue
        entry = by_parent.setdefault(h.parent, (h, {}, []))
        entry[1].update(_settings(controller, h.version, value))
        entry[2].append(controller)
    for h, settings, controllers in by_parent.values():
        leaf = h.parent / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            leaf.mkdir()
        except OSError as e:
            notes.append(f"cannot create a {'/'.join(controllers)} cgroup: {e}")
            continue
        leaves.paths.append(leaf)
        for name, value in settings.items():
            try:
                (leaf / name).write_text(value)
            except OSError as e:
                if name.startswith("memory.memsw") or name == "memory.swap.max":
                    continue  # no swap accounting: nothing to close
                notes.append(f"cannot set {name}: {e}")
        if "memory" in controllers:
            leaves.memory = leaf
    return leaves, notes


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
