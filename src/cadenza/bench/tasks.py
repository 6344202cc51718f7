"""`cadenza bench tasks SOURCE`: task-building throughput against the project's own suite.

Figures: tasks per hour of build wall time, and validation time per candidate relative to
one full run of the project's test suite (the baseline, median of 3 runs measured here on
the same machine in the same process; goal <= 2x). Validation runs every gate (removal,
three agreeing runs of the hidden tests, gold, stub, leak scan) but only the affected tests
where that is sound.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from cadenza.bench._util import median_time
from cadenza.tasks.build import BuildOptions, build
from cadenza.tasks.environment import EnvSpec, ensure_venv
from cadenza.tasks.runner import SubprocessRunner
from cadenza.tasks.scrub import apply_patch
from cadenza.tasks.source import default_cache_dir
from cadenza.tasks.store import read_tasks, unpack_workspace
from cadenza.tasks.testrun import run_tests


def run(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="cadenza bench tasks")
    p.add_argument("source", nargs="?", default="pypi:inflection")
    p.add_argument("--max-tasks", type=int, default=2)
    p.add_argument("--max-candidates", type=int, default=3)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--exclude-failing", action="store_true")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="cadenza-bench-") as tmp:
        out = Path(tmp) / "tasks"
        summary = build(
            args.source,
            out,
            BuildOptions(
                max_tasks=args.max_tasks,
                max_candidates=args.max_candidates,
                workers=args.workers,
                exclude_failing=args.exclude_failing,
            ),
            log=lambda m: None,
        )
        tasks = read_tasks(out)
        if not tasks:
            raise SystemExit(
                f"no task was accepted from {args.source}: {summary['rejection_reasons']}"
            )
        # baseline: the original project's full suite (a task's workspace + gold + hidden tests)
        task = tasks[0]
        venv = ensure_venv(EnvSpec(**task["environment_setup"]), default_cache_dir())
        ws = Path(tmp) / "original"
        unpack_workspace(out / "workspaces" / f"{task['instance_id']}.tar", ws)
        for patch in (task["patch"], task["test_patch"]):
            assert apply_patch(ws, patch) is None
        runner = SubprocessRunner()
        suite_s = median_time(lambda: run_tests(runner, ws, venv, timeout=600), repeats=3, warmup=0)

    per_task = statistics.median(summary["validation_seconds"])  # every candidate tried
    per_accepted = statistics.median(summary["accepted_validation_seconds"])
    result = {
        "source": args.source,
        "accepted": summary["accepted"],
        "candidates": summary["accepted"] + summary["rejected"],
        "build_seconds": round(summary["build_seconds"], 2),
        "tasks_per_hour": round(summary["accepted"] / summary["build_seconds"] * 3600, 1),
        "suite_seconds_baseline": round(suite_s, 3),
        "validation_seconds_per_candidate": round(per_task, 2),
        "validation_seconds_per_accepted_task": round(per_accepted, 2),
        "validation_vs_suite": round(per_task / suite_s, 2),
        "rejection_reasons": summary["rejection_reasons"],
        "gate_seconds": summary["gate_seconds"],
    }
    print(
        f"{args.source}: {result['accepted']}/{result['candidates']} candidates accepted in "
        f"{result['build_seconds']}s -> {result['tasks_per_hour']} tasks/hour"
    )
    print(
        f"validation per candidate {per_task:.2f}s vs one full suite run {suite_s:.2f}s "
        f"(baseline, median of 3) = {result['validation_vs_suite']}x (goal <= 2x)"
    )
    return result
