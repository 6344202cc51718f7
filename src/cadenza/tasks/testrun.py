"""Run a project's pytest suite in a workspace and read pytest's own per-test report.

Outcomes per test id come from the `cadenza_probe` plugin (pytest's TestReport objects):
"passed", "failed", "error", "skipped", "xfailed", "xpassed". Optionally under coverage.py
with the test id as dynamic context, which is what feature discovery reads.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cadenza.tasks.environment import PROBE_MODULE
from cadenza.tasks.runner import Runner
from cadenza.tasks.source import import_root

RUN_DIR = ".cadenza-run"  # scratch inside the workspace (visible to a sandbox), removed after


@dataclass
class TestRun:
    outcomes: dict[str, str]
    collect_errors: list[str]
    returncode: int
    timed_out: bool
    duration_s: float
    output: str = ""
    coverage: dict[str, dict[int, list[str]]] = field(default_factory=dict)  # file -> line -> ids
    repeats: dict[str, list[str]] = field(default_factory=dict)  # id -> outcome per repetition

    def passed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o == "passed"}

    def failing(self) -> dict[str, str]:
        return {t: o for t, o in self.outcomes.items() if o not in ("passed", "skipped")}


def run_tests(
    runner: Runner,
    workspace: Path,
    venv: Path,
    *,
    timeout: float,
    select: list[str] | None = None,
    coverage: bool = False,
    repeat: int = 1,
) -> TestRun:
    """Run pytest once in workspace with the project's environment (select: only these ids;
    repeat: run them that many times in a row in the same process)."""
    workspace = workspace.resolve()
    scratch = workspace / RUN_DIR
    shutil.rmtree(scratch, ignore_errors=True)
    (scratch / "home").mkdir(parents=True)
    env = {
        "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(scratch / "home"),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str((workspace / import_root(workspace)).resolve()),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "CADENZA_PROBE_OUT": str(scratch / "report.json"),
    }
    if select is not None:
        (scratch / "select.txt").write_text("\n".join(select) + "\n")
        env["CADENZA_PROBE_SELECT"] = str(scratch / "select.txt")
    if repeat > 1:
        env["CADENZA_PROBE_REPEAT"] = str(repeat)
    argv = [str(venv / "bin" / "python")]
    if coverage:
        argv += [
            "-m",
            "coverage",
            "run",
            f"--data-file={scratch / 'coverage'}",
            f"--source={workspace}",
        ]
    argv += [
        "-m",
        "pytest",
        "-p",
        PROBE_MODULE,
        "-p",
        "no:cacheprovider",
        "-q",
        f"--rootdir={workspace}",
        "--continue-on-collection-errors",
    ]
    if select:
        # collect only the files the selected tests live in (ids are rootdir-relative)
        files = sorted({t.split("::")[0] for t in select})
        if all((workspace / f).is_file() for f in files):
            argv += ["--", *files]
    try:
        res = runner.run(argv, workspace, timeout=timeout, env=env, ro_binds=[venv])
        report_path = scratch / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        cov = (
            _read_coverage(scratch / "coverage", workspace)
            if coverage and not res.timed_out
            else {}
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return TestRun(
        outcomes=report.get("tests", {}),
        collect_errors=report.get("collect_errors", [] if report else ["<no report>"]),
        returncode=res.returncode,
        timed_out=res.timed_out,
        duration_s=res.duration_s,
        output=(res.stdout + res.stderr)[-4000:],
        coverage=cov,
        repeats=report.get("repeats", {}),
    )


def _read_coverage(data_file: Path, workspace: Path) -> dict[str, dict[int, list[str]]]:
    from coverage import CoverageData

    if not data_file.exists():
        return {}
    data = CoverageData(basename=str(data_file))
    data.read()
    out = {}
    for f in data.measured_files():
        rel = os.path.relpath(f, workspace)
        if rel.startswith(".."):
            continue
        by_line = data.contexts_by_lineno(f)
        out[Path(rel).as_posix()] = {
            int(n): [c for c in ctxs if c] for n, ctxs in by_line.items() if any(ctxs)
        }
    return out
