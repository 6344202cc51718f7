"""`cadenza tasks build`: from a project to a directory of validated, leak-free tasks.

1. resolve the source and rebuild it from the whitelist (scrub by construction);
2. one environment per project; the project must not be importable from it;
3. the original suite: once under per-test coverage, twice more plain; it must pass
   (flaky tests, whose outcomes differ between runs, are excluded);
4. discover features, keep those in the difficulty band, validate them in a process pool;
5. write DIR atomically: tasks.jsonl, workspaces/, rejected.jsonl, build.json.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cadenza.tasks.discover import Feature, find_features, find_module_features
from cadenza.tasks.environment import ensure_venv, spec_for
from cadenza.tasks.errors import TaskError
from cadenza.tasks.gates import Job, validate
from cadenza.tasks.remove_agent import AgentRemoverOptions, chat_url
from cadenza.tasks.runner import Runner, SandboxRunner, default_runner
from cadenza.tasks.scrub import copy_files
from cadenza.tasks.source import (
    check_buildable,
    default_cache_dir,
    import_root,
    library_files,
    resolve,
    top_level_names,
    whitelist,
)
from cadenza.tasks.store import check_schema, write_json_atomic
from cadenza.tasks.testrun import run_tests

# Bands over `difficulty_score`; a band is [low, high).
BANDS = {"easy": (0.0, 1.5), "medium": (1.5, 4.0), "hard": (4.0, math.inf), "any": (0.0, math.inf)}


@dataclass
class BuildOptions:
    max_tasks: int = 10
    workers: int = 1
    difficulty: str = "any"
    timeout: float = 600.0  # per test-suite run
    with_signature: bool = True
    exclude_failing: bool = False  # drop tests failing in the original instead of refusing
    max_candidates: int | None = None  # candidates tried (default: 4 x max_tasks)
    cache_dir: Path | None = None
    sandbox: bool = False  # gates in cadenza.sandbox (slower); grading always uses it
    remover: str = "ast"  # "ast" (exact spans) | "agent" (a chat model with tools; needs agent)
    agent: AgentRemoverOptions | None = None


def difficulty_features(f: Feature) -> dict[str, Any]:
    return {
        "lines_removed": f.lines,
        "symbols_removed": len(f.defs),
        "files_removed": f.files_removed,
        "centrality": round(f.centrality, 4),
        "callers": len(f.callers),
    }


def difficulty_score(d: dict[str, Any]) -> float:
    """lines/20 + extra symbols + 2 per removed file + 10 x centrality."""
    return (
        d["lines_removed"] / 20
        + (d["symbols_removed"] - 1)
        + 2 * d["files_removed"]
        + 10 * d["centrality"]
    )


def check_not_installed(venv: Path, names: list[str]) -> None:
    """The project must be importable only from the workspace, never from the environment."""
    code = "import importlib.util as u, sys; print([n for n in sys.argv[1:] if u.find_spec(n)])"
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-c", code, *names],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=120,
    )
    found = json.loads(r.stdout.replace("'", '"') or "[]") if r.returncode == 0 else names
    if found:
        raise TaskError(
            f"an installed copy of {', '.join(found)} is importable from the environment {venv}; "
            "the project must be importable only from the workspace: delete that environment "
            "(it is rebuilt) or uninstall the package from it"
        )


def _prepare_out(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TaskError(
            f"{out}: already exists and is not empty; expected a new directory for the tasks"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))


def build(
    source: str,
    out: Path,
    options: BuildOptions | None = None,
    runner: Runner | None = None,
    log=print,
) -> dict[str, Any]:
    """Build tasks from source into out; returns the build summary (also out/build.json)."""
    opts = options or BuildOptions()
    if opts.difficulty not in BANDS:
        raise TaskError(f"--difficulty {opts.difficulty!r}: expected one of {', '.join(BANDS)}")
    if opts.remover not in ("ast", "agent"):
        raise TaskError(f"--remover {opts.remover!r}: expected ast or agent")
    if opts.remover == "agent":
        if opts.agent is None or not opts.agent.endpoint or not opts.agent.model:
            raise TaskError(
                "--remover agent needs --endpoint URL and --model NAME of an OpenAI-compatible "
                "chat server"
            )
        chat_url(opts.agent.endpoint)  # a bad URL fails here, before any test runs
    runner = runner or (SandboxRunner() if opts.sandbox else default_runner())
    cache = opts.cache_dir or default_cache_dir()
    out = Path(out)
    tmp_out = _prepare_out(out)
    project = None
    work = Path(tempfile.mkdtemp(prefix="cadenza-build-"))
    t_start = time.monotonic()
    try:
        project = resolve(source, cache)
        files = whitelist(project.root)
        check_buildable(project.root, files)
        baseline = work / "baseline"
        copy_files(project.root, baseline, files)
        spec = spec_for(project.name, project.version, project.root)
        venv = ensure_venv(spec, cache)
        check_not_installed(venv, top_level_names(baseline, files))
        log(f"{project.name} {project.version}: {len(files)} files, environment {venv.name}")

        runs = [run_tests(runner, baseline, venv, timeout=opts.timeout, coverage=True)]
        first = runs[0]
        if first.timed_out:
            raise TaskError(
                f"the original test suite did not finish within {opts.timeout:.0f}s (a hanging "
                "test?); fix or deselect it, or raise the timeout"
            )
        if first.collect_errors:
            raise TaskError(
                f"the original test suite does not collect: errors in {', '.join(first.collect_errors[:3])}"
                f"\n{first.output[-1500:]}"
            )
        if not first.outcomes:
            raise TaskError("the test suite collected no tests; tasks need tests to verify them")
        failing = first.failing()
        if failing and not opts.exclude_failing:
            some = ", ".join(f"{t} ({o})" for t, o in list(failing.items())[:3])
            raise TaskError(
                f"the original test suite fails: {len(failing)} of {len(first.outcomes)} tests, "
                f"e.g. {some}; tasks need a passing suite: fix the project, or pass "
                "--exclude-failing to leave those tests out"
            )
        for _ in range(2):
            runs.append(run_tests(runner, baseline, venv, timeout=opts.timeout))
        suite_seconds = sorted(r.duration_s for r in runs[1:])[0]
        passing = set.intersection(*(r.passed() for r in runs))
        flaky = sorted(set.union(*(r.passed() for r in runs)) - passing)
        log(
            f"original suite: {len(first.outcomes)} tests, {len(passing)} pass in all 3 runs, "
            f"{len(flaky)} flaky, {suite_seconds:.2f}s per run"
        )

        texts = {r: (baseline / r).read_text() for r in files if r.endswith(".py")}
        library = library_files(baseline, files)
        root = import_root(baseline)
        features = find_features(texts, library, first.coverage, passing, root)
        features += find_module_features(texts, library, first.coverage, passing, root)
        lo, hi = BANDS[opts.difficulty]
        scored = [(difficulty_score(difficulty_features(f)), f) for f in features]
        in_band = sorted(
            ((s, f) for s, f in scored if lo <= s < hi),
            key=lambda x: (x[1].file, x[1].defs[0].start),
        )
        limit = opts.max_candidates or 4 * opts.max_tasks
        # spread the tries over the project rather than the first module's top
        step = max(1, len(in_band) // limit) if in_band else 1
        candidates = [f for _, f in in_band[::step]][:limit]
        log(
            f"{len(features)} features, {len(in_band)} in band {opts.difficulty!r}, "
            f"trying {len(candidates)}"
        )

        cov = {r: first.coverage.get(r, {}) for r in library}
        proj = {
            "name": project.name,
            "version": project.version,
            "source": source,
            "sdist_sha256": project.sha256,
        }
        (tmp_out / "workspaces").mkdir()
        jobs = [
            Job(
                feature=f,
                baseline=baseline,
                files=files,
                venv=venv,
                env_spec=spec,
                passing=sorted(passing),
                coverage=cov,
                tar_path=tmp_out
                / "workspaces"
                / f"{project.name}-{project.version}__{f.module}.{f.name}.tar",
                project=proj,
                timeout=opts.timeout,
                with_signature=opts.with_signature,
                difficulty=difficulty_features(f),
                sandboxed=opts.sandbox,
                agent=opts.agent if opts.remover == "agent" else None,
            )
            for f in candidates
        ]
        accepted, rejected = _run_jobs(jobs, opts, log)

        tasks = [r["instance"] for r in accepted]
        check_schema(tasks)
        with open(tmp_out / "tasks.jsonl", "w") as fh:
            for t in tasks:
                fh.write(json.dumps(t, sort_keys=True) + "\n")
        with open(tmp_out / "rejected.jsonl", "w") as fh:
            for r in rejected:
                fh.write(json.dumps({"feature": r["feature"], "reason": r["reason"]}) + "\n")
        summary = {
            "project": proj,
            "environment": asdict(spec),
            "tests": len(first.outcomes),
            "passing_tests": len(passing),
            "flaky_tests": flaky,
            "excluded_failing": sorted(failing),
            "suite_seconds": suite_seconds,
            "features": len(features),
            "candidates": len(jobs),
            "accepted": len(tasks),
            "rejected": len(rejected),
            "rejection_reasons": _reason_counts(rejected),
            "validation_seconds": [r["seconds"] for r in accepted + rejected],
            "accepted_validation_seconds": [r["seconds"] for r in accepted],
            "gate_seconds": [r["gate_seconds"] for r in accepted],
            "build_seconds": time.monotonic() - t_start,
            "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        }
        write_json_atomic(tmp_out / "build.json", summary)
        if out.exists():
            out.rmdir()
        os.replace(tmp_out, out)
        log(f"{len(tasks)} task(s) written to {out}; {len(rejected)} candidate(s) rejected")
        return summary
    except BaseException:
        shutil.rmtree(tmp_out, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if project is not None:
            project.cleanup()


def _reason_counts(rejected: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rejected:
        kind = r["reason"].split(":")[0].split(",")[0][:60]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _run_jobs(jobs: list[Job], opts: BuildOptions, log) -> tuple[list[dict], list[dict]]:
    """Validate in waves of `workers` until max_tasks are accepted (candidate order kept)."""
    accepted: list[dict] = []
    rejected: list[dict] = []
    workers = max(1, min(opts.workers, 2, os.cpu_count() or 1))
    pool = (
        ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        if workers > 1
        else None
    )
    try:
        i = 0
        while i < len(jobs) and len(accepted) < opts.max_tasks:
            wave = jobs[i : i + max(workers, 1)]
            i += len(wave)
            results = list(pool.map(validate, wave)) if pool else [validate(j) for j in wave]
            for r in results:
                if r["ok"] and len(accepted) < opts.max_tasks:
                    accepted.append(r)
                    log(f"  accepted {r['instance']['instance_id']} ({r['seconds']:.1f}s)")
                elif r["ok"]:
                    Path(
                        next(
                            j.tar_path
                            for j in wave
                            if j.tar_path.name.startswith(r["instance"]["instance_id"])
                        )
                    ).unlink(missing_ok=True)
                else:
                    if r.get("fatal"):
                        raise TaskError(f"{r['feature']}: {r['reason']}")
                    rejected.append(r)
                    log(f"  rejected {r['feature']}: {r['reason'][:200]}")
    finally:
        if pool:
            pool.shutdown()
    return accepted, rejected


__all__ = ["BANDS", "BuildOptions", "build", "difficulty_score"]
