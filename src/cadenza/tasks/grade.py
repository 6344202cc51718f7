"""Grading: a prediction (a patch) against a task's hidden tests, in a fresh workspace.

The prediction may change library code only: file diffs touching tests, conftest, test
configuration or interpreter startup hooks are dropped (and reported). Pristine tests and
configuration are restored, the hidden tests re-added (test_patch), and pytest's own report
decides: a test counts only if it ran and passed; absent, skipped, errored, xfailed count as
failures. `resolved` = every FAIL_TO_PASS and PASS_TO_PASS test passed.
"""

from __future__ import annotations

import json
import re
import shutil
import tarfile
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from cadenza.tasks.environment import EnvSpec, ensure_venv
from cadenza.tasks.errors import TaskError
from cadenza.tasks.runner import Runner, grading_runner
from cadenza.tasks.scrub import apply_patch, listed_files
from cadenza.tasks.source import default_cache_dir, is_protected
from cadenza.tasks.store import find_task, read_tasks, unpack_workspace, write_json_atomic
from cadenza.tasks.testrun import run_tests


def split_patch(patch: str) -> list[tuple[set[str], str]]:
    """A patch as (paths it touches, its text) per file section."""
    lines = patch.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith("diff --git ")]
    if not starts:  # plain unified diff: a section starts at "--- " followed by "+++ "
        starts = [
            i
            for i, line in enumerate(lines[:-1])
            if line.startswith("--- ") and lines[i + 1].startswith("+++ ")
        ]
    if not starts:
        return [(set(), patch)] if patch.strip() else []
    sections = []
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        text = "".join(lines[a:b])
        paths = set()
        for line in lines[a:b]:
            m = re.match(r"diff --git a/(\S+) b/(\S+)", line)
            if m:
                paths |= {m.group(1), m.group(2)}
            m = re.match(
                r"(?:---|\+\+\+|rename from|rename to|copy from|copy to) (?:[ab]/)?(\S+)", line
            )
            if m and m.group(1) != "/dev/null":
                paths.add(m.group(1))
            if line.startswith("@@"):
                break
        sections.append((paths, text))
    return sections


def filter_patch(patch: str) -> tuple[str, list[str]]:
    """(the patch without sections touching protected paths, the protected paths touched)."""
    kept, dropped = [], []
    for paths, text in split_patch(patch):
        if not paths:
            dropped.append("<section without file names>")
            continue
        bad = sorted(p for p in paths if is_protected(p) or p.split("/")[0] == ".git")
        if bad:
            dropped += bad
        else:
            kept.append(text)
    return "".join(kept), dropped


def score(
    outcomes: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str]
) -> dict[str, Any]:
    """Pure scoring of pytest outcomes: only "passed" passes; missing tests fail."""

    def passed(ids: list[str]) -> list[str]:
        return [t for t in ids if outcomes.get(t) == "passed"]

    f2p, p2p = passed(fail_to_pass), passed(pass_to_pass)
    total = len(fail_to_pass) + len(pass_to_pass)
    return {
        "resolved": len(f2p) == len(fail_to_pass) and len(p2p) == len(pass_to_pass) and total > 0,
        "pass_fraction": (len(f2p) + len(p2p)) / total if total else 0.0,
        "fail_to_pass_passed": len(f2p),
        "pass_to_pass_passed": len(p2p),
        "failed_tests": sorted(
            f"{t} ({outcomes.get(t, 'absent')})"
            for t in fail_to_pass + pass_to_pass
            if outcomes.get(t) != "passed"
        )[:50],
    }


def grade_prediction(
    task: dict[str, Any],
    workspace_tar: Path,
    model_patch: str,
    *,
    runner: Runner | None = None,
    cache_dir: Path | None = None,
    timeout: float = 600,
    select: list[str] | None = None,
    venv: Path | None = None,
) -> dict[str, Any]:
    """Grade one prediction; select restricts PASS_TO_PASS to these ids (build-time gates)."""
    runner = runner or grading_runner()
    if venv is None:
        venv = ensure_venv(EnvSpec(**task["environment_setup"]), cache_dir or default_cache_dir())
    f2p, p2p = task["FAIL_TO_PASS"], task["PASS_TO_PASS"]
    if select is not None:
        keep = set(select)
        p2p = [t for t in p2p if t in keep]
    ws = Path(tempfile.mkdtemp(prefix="cadenza-grade-"))
    try:
        unpack_workspace(workspace_tar, ws)
        kept, dropped = filter_patch(model_patch or "")
        error = apply_patch(ws, kept)
        if error is not None:
            return {
                **score({}, f2p, p2p),
                "error": f"patch does not apply: {error[:500]}",
                "dropped_paths": dropped,
            }
        _restore_protected(ws, workspace_tar)
        error = apply_patch(ws, task["test_patch"])
        if error is not None:
            return {
                **score({}, f2p, p2p),
                "error": f"test_patch does not apply: {error[:500]}",
                "dropped_paths": dropped,
            }
        run = run_tests(runner, ws, venv, timeout=timeout, select=f2p + p2p)
        result = score(run.outcomes, f2p, p2p)
        result["dropped_paths"] = dropped
        result["error"] = "timed out" if run.timed_out else None
        return result
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def _restore_protected(ws: Path, workspace_tar: Path) -> None:
    with tarfile.open(workspace_tar) as tar:
        pristine = {m.name for m in tar.getmembers() if m.isfile()}
        for rel in listed_files(ws):
            if is_protected(rel) and rel not in pristine:
                (ws / rel).unlink()
        for m in tar.getmembers():
            if m.isfile() and is_protected(m.name):
                (ws / m.name).parent.mkdir(parents=True, exist_ok=True)
                (ws / m.name).write_bytes(tar.extractfile(m).read())


def _grade_one(args: tuple) -> tuple[str, dict[str, Any]]:
    out_dir, task, patch, timeout = args
    tar = Path(out_dir) / "workspaces" / f"{task['instance_id']}.tar"
    try:
        return task["instance_id"], grade_prediction(task, tar, patch, timeout=timeout)
    except TaskError as e:
        return task["instance_id"], {
            **score({}, task["FAIL_TO_PASS"], task["PASS_TO_PASS"]),
            "error": str(e),
        }


def read_predictions(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise TaskError(
            f"{path}: no such predictions file (expected JSONL with instance_id, model_patch)"
        )
    preds = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            p = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(
                f"{path}:{i}: not JSON ({e}); expected one prediction object per line"
            ) from e
        if not isinstance(p, dict) or "instance_id" not in p or "model_patch" not in p:
            raise TaskError(
                f"{path}:{i}: expected keys instance_id and model_patch, found {list(p)[:5]}"
            )
        preds.append(p)
    return preds


def grade_dir(
    out_dir: Path, predictions: Path, report: Path, *, workers: int = 1, timeout: float = 600
) -> dict[str, Any]:
    """Grade SWE-bench-format predictions against DIR's tasks; writes REPORT.json."""
    read_tasks(out_dir)
    jobs = []
    for p in read_predictions(predictions):
        task = find_task(out_dir, p["instance_id"])
        jobs.append((str(out_dir), task, p["model_patch"] or "", timeout))
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=min(workers, 2)) as pool:
            results = dict(pool.map(_grade_one, jobs))
    else:
        results = dict(map(_grade_one, jobs))
    for p in read_predictions(predictions):
        results[p["instance_id"]]["model_name_or_path"] = p.get("model_name_or_path", "")
    report.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(report, results)
    return results
