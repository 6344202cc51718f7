"""`cadenza bench sandbox`: per-command cost of the sandbox over a plain subprocess.

For each command (`true`, `python -c pass`) it times, interleaved round by round so
drift in machine load hits both alike: a plain `subprocess.run` (the baseline) and
`Sandbox.run` (bubblewrap + limits + pids cgroup + capped output). Prints the medians,
the added milliseconds (goal: <= 20 ms) and the ratio.

    cadenza bench sandbox [--repeats 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cadenza.sandbox import Sandbox, isolation

GOAL_MS = 20.0


def _python_binds() -> list[Path]:
    return [Path(p) for p in {sys.prefix, sys.base_prefix} if not p.startswith("/usr")]


def _time(fn) -> tuple[float, float]:
    """Wall seconds, and CPU seconds (user + sys) of this process and its children."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    s0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    s1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = sum(b.ru_utime + b.ru_stime - a.ru_utime - a.ru_stime for a, b in ((r0, r1), (s0, s1)))
    return wall, cpu


def measure(argv: list[str], box: Sandbox, repeats: int) -> dict:
    """Median seconds of a plain subprocess vs the sandbox, `repeats` interleaved rounds."""

    def plain():
        r = subprocess.run(argv, cwd=box.workspace, capture_output=True)
        assert r.returncode == 0, r.stderr

    def sandboxed():
        r = box.run(argv)
        assert r.returncode == 0, r.stderr

    plain(), sandboxed()  # warm-up: page cache, the one-time namespace probe
    base, boxed = [], []
    for _ in range(repeats):
        base.append(_time(plain))
        boxed.append(_time(sandboxed))
    b, s = (statistics.median(w for w, _ in x) for x in (base, boxed))
    bc, sc = (statistics.median(c for _, c in x) for x in (base, boxed))
    return {
        "command": " ".join(argv),
        "plain_ms": b * 1e3,
        "sandbox_ms": s * 1e3,
        "added_ms": (s - b) * 1e3,
        "ratio": s / b,
        "plain_cpu_ms": bc * 1e3,
        "sandbox_cpu_ms": sc * 1e3,
        "added_cpu_ms": (sc - bc) * 1e3,
    }


def run(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="cadenza bench sandbox", description=__doc__)
    p.add_argument("--repeats", type=int, default=30, help="rounds per command (median)")
    p.add_argument("--unsafe", action="store_true", help="time the unsandboxed path instead")
    args = p.parse_args(argv)
    iso = isolation()
    if not iso.available and not args.unsafe:
        raise SystemExit(f"bench sandbox: no usable bubblewrap here ({'; '.join(iso.notes)})")
    ws = Path(tempfile.mkdtemp(prefix="cadenza-bench-sandbox-"))
    try:
        box = Sandbox(ws, ro_binds=_python_binds(), timeout=60, unsafe=args.unsafe)
        rows = [
            measure(["true"], box, args.repeats),
            measure([sys.executable, "-c", "pass"], box, args.repeats),
        ]
    finally:
        shutil.rmtree(ws, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"sandbox overhead per command, median of {args.repeats} (baseline: plain subprocess)")
    print(
        f"  isolation: {', '.join(iso.namespaces)}; seccomp: {iso.seccomp}; "
        f"cgroups: {', '.join(iso.cgroups) or 'none'}"
    )
    print(f"  machine: {os.cpu_count()} CPUs, load average {load:.1f} (wall times grow with load)")
    print(
        f"  {'command':<16}{'plain ms':>10}{'sandbox ms':>12}{'added ms':>10}{'ratio':>8}"
        f"{'added CPU ms':>14}"
    )
    for r in rows:
        name = "python -c pass" if r["command"].endswith("-c pass") else r["command"]
        print(
            f"  {name:<16}{r['plain_ms']:>10.2f}{r['sandbox_ms']:>12.2f}"
            f"{r['added_ms']:>10.2f}{r['ratio']:>7.2f}x{r['added_cpu_ms']:>14.2f}"
        )
    worst = max(r["added_ms"] for r in rows)
    verdict = "meets" if worst <= GOAL_MS else "misses"
    print(f"  worst added wall: {worst:.2f} ms ({verdict} the {GOAL_MS:g} ms goal)")
    return {
        "repeats": args.repeats,
        "rows": rows,
        "goal_ms": GOAL_MS,
        "worst_added_ms": worst,
        "load_average": load,
    }
