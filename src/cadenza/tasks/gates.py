"""Validate one candidate feature into a task, or reject it with the reason.

Gates, in order (the original suite was checked once per project by the build):
A. after removal the suite collects and every PASS_TO_PASS test passes;
B. with the hidden tests re-added, three runs (one process, repeated) agree and the
   FAIL_TO_PASS tests fail;
C. re-applying the gold patch resolves the task (graded like a prediction);
D. a stub raising NotImplementedError does not;
E. the leak scan finds nothing in the workspace (git objects included) or the environment.
Only the affected tests run in C and D (those that executed a changed file), which is sound
because A already ran every other test against the same non-test code.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cadenza.tasks.discover import Feature, module_name, test_key, tests_naming
from cadenza.tasks.environment import EnvSpec, site_packages
from cadenza.tasks.errors import TaskError
from cadenza.tasks.grade import grade_prediction
from cadenza.tasks.leaks import scan_tree, secret_for
from cadenza.tasks.remove import (
    RemovalError,
    drop_module_imports,
    drop_references,
    remove_definitions,
    remove_tests,
)
from cadenza.tasks.remove_agent import (
    AgentRemoval,
    AgentRemoverOptions,
    EndpointError,
    remove_with_agent,
    summarize_run,
)
from cadenza.tasks.runner import Runner, SandboxRunner, default_runner
from cadenza.tasks.scrub import apply_patch, copy_files, diff_to, git, init_repo, write_files
from cadenza.tasks.source import import_root, is_test_file, library_files
from cadenza.tasks.statement import problem_statement
from cadenza.tasks.store import pack_workspace
from cadenza.tasks.testrun import run_tests


class Rejected(Exception):
    """A candidate failed a gate; the message is the reason logged."""


@dataclass
class Job:
    feature: Feature
    baseline: Path  # scrubbed original workspace (whitelisted files only)
    files: list[str]
    venv: Path
    env_spec: EnvSpec
    passing: list[str]  # tests that passed in all three original runs
    coverage: dict[str, dict[int, list[str]]]  # library files only
    tar_path: Path  # where the accepted workspace goes
    project: dict[str, str]  # name, version, source, sha256
    timeout: float = 600
    with_signature: bool = True
    difficulty: dict[str, Any] = field(default_factory=dict)
    sandboxed: bool = False  # run the gates in cadenza.sandbox (else plain subprocesses)
    agent: AgentRemoverOptions | None = None  # remove with a chat model instead of ast spans


def stub_text(text: str, feature: Feature) -> str:
    """The original module with the feature's definitions replaced by NotImplementedError stubs."""
    lines = text.splitlines(keepends=True)
    for d in sorted(feature.defs, key=lambda d: -d.start):
        if d.kind == "class":
            stub = [
                f"class {d.name}:\n",
                "    def __init__(self, *args, **kwargs):\n",
                "        raise NotImplementedError\n",
            ]
        else:
            stub = [f"def {d.name}(*args, **kwargs):\n", "    raise NotImplementedError\n"]
        lines[d.start - 1 : d.end] = stub
    return "".join(lines)


def plan_removal(
    texts: dict[str, str], library: list[str], feature: Feature, root: str = "."
) -> tuple[dict[str, str | None], set[str], list[str]]:
    """Library edits: definitions out, re-exports and aliases out (across modules, to a
    fixpoint). Returns (changed files, every removed name, modules that re-exported it)."""
    names = set(feature.names)
    changed: dict[str, str | None] = {}
    if feature.kind == "module":
        changed[feature.file] = None
        public = {d.name for d in feature.defs if not d.name.startswith("_")}
        for rel in library:
            if rel == feature.file:
                continue
            new, bound = drop_module_imports(
                texts[rel],
                module_name(rel, root),
                rel.endswith("__init__.py"),
                feature.module,
                public,
            )
            if new != texts[rel]:
                changed[rel] = new
                names |= bound
    else:
        text = remove_definitions(texts[feature.file], feature.defs)
        text, aliases = drop_references(text, names)
        changed[feature.file] = text
        names |= aliases
    exported = []
    grew = True
    while grew:
        grew = False
        for rel in library:
            cur = changed.get(rel, texts[rel])
            if cur is None:
                continue
            new, more = drop_references(cur, names)
            if new != cur:
                changed[rel] = new
                if rel != feature.file and rel not in exported:
                    exported.append(rel)
            if more - names:
                names |= more
                grew = True
    return changed, names, exported


def _exports(texts: dict[str, str], feature: Feature, root: str, exported: list[str]) -> list[str]:
    mods = [module_name(r, root) for r in exported]
    parent, _, last = feature.module.rpartition(".")
    if parent:
        init = next(
            (r for r in texts if module_name(r, root) == parent and r.endswith("__init__.py")), None
        )
        if init and f"from .{last} import *" in texts[init] and parent not in mods:
            mods.append(parent)
    return mods


def _agent_removal(
    job: Job,
    runner: Runner,
    texts: dict[str, str],
    library: list[str],
    test_changes: dict[str, str | None],
    hidden_ids: list[str],
    visible: list[str],
) -> AgentRemoval:
    """The model removes the feature from a copy without the hidden tests; its library edits."""
    assert job.agent is not None
    aws = Path(tempfile.mkdtemp(prefix="cadenza-agent-remove-"))
    try:
        copy_files(job.baseline, aws, job.files)
        write_files(aws, test_changes)

        def run_visible() -> str:
            return summarize_run(run_tests(runner, aws, job.venv, timeout=job.timeout), visible)

        return remove_with_agent(
            aws,
            job.feature,
            hidden_ids,
            {r: texts[r] for r in library},
            job.agent,
            run_visible,
        )
    finally:
        shutil.rmtree(aws, ignore_errors=True)


def validate(job: Job, runner: Runner | None = None) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        clock: dict[str, float] = {}
        runner = runner or (SandboxRunner() if job.sandboxed else default_runner())
        instance = _validate(job, runner, clock)
        return {
            "ok": True,
            "instance": instance,
            "seconds": time.monotonic() - t0,
            "gate_seconds": clock,
        }
    except (Rejected, RemovalError, TaskError) as e:
        return {
            "ok": False,
            "feature": f"{job.feature.module}.{job.feature.name}",
            "reason": str(e),
            "seconds": time.monotonic() - t0,
            "fatal": isinstance(e, EndpointError),  # every other candidate would fail alike
        }


def _validate(job: Job, runner: Runner, clock: dict[str, float] | None = None) -> dict[str, Any]:
    clock = {} if clock is None else clock
    last = [time.monotonic()]

    def lap(name: str) -> None:
        now = time.monotonic()
        clock[name] = round(now - last[0], 3)
        last[0] = now

    f = job.feature
    root = import_root(job.baseline)
    texts = {r: (job.baseline / r).read_text() for r in job.files if r.endswith(".py")}
    library = library_files(job.baseline, job.files)
    test_files = [r for r in job.files if is_test_file(r)]
    passing = set(job.passing)

    try:
        lib_changes, names, exported = plan_removal(texts, library, f, root)
    except RemovalError:
        if job.agent is None:
            raise
        # the hidden tests are still those naming the feature's own definitions
        lib_changes, names, exported = {}, set(f.names), []
    keys, whole = tests_naming(texts, test_files, names)
    hidden_keys = {test_key(t) for t in f.tests} | keys
    hidden = {t for t in passing if test_key(t) in hidden_keys or t.split("::")[0] in whole}
    hidden_keys |= {test_key(t) for t in hidden}
    if not hidden:
        raise Rejected("no passing test exercises it")
    test_changes: dict[str, str | None] = {}
    for rel in test_files:
        if not any(k[0] == rel for k in hidden_keys) and not set(names) & set(
            re.findall(r"\w+", texts[rel])
        ):
            continue
        new = remove_tests(rel, texts[rel], hidden_keys)
        if new is not None:
            new, _ = drop_references(new, names, aliases=False)
        if new != texts[rel]:
            test_changes[rel] = new
    hidden_ids = sorted(hidden)
    visible_p2p = sorted(passing - hidden)
    if not visible_p2p:
        raise Rejected("no test is left to check that the rest still works")
    remover: dict[str, Any] = {"strategy": "ast"}
    if job.agent is not None:
        done = _agent_removal(job, runner, texts, library, test_changes, hidden_ids, visible_p2p)
        lib_changes = done.changes
        exported = [r for r in lib_changes if r != f.file]
        remover = {
            "strategy": "agent",
            "model": job.agent.model,
            "turns": done.turns,
            "completion_tokens": done.completion_tokens,
            "tool_errors": done.tool_errors,
        }
        lap("agent_removal")

    ws = Path(tempfile.mkdtemp(prefix="cadenza-task-"))
    try:
        copy_files(job.baseline, ws, job.files)
        write_files(ws, {**lib_changes, **test_changes})
        base_commit = init_repo(ws)
        pack_workspace(ws, job.tar_path)
        gold = diff_to(ws, {r: texts[r] for r in lib_changes})
        test_patch = diff_to(ws, {r: texts[r] for r in test_changes})

        lap("prepare")
        # A: the remaining suite still collects and passes
        run = run_tests(runner, ws, job.venv, timeout=job.timeout)
        if run.timed_out:
            raise Rejected(f"suite timed out after removal ({job.timeout:.0f}s)")
        if run.collect_errors:
            errors = [ln.strip() for ln in run.output.splitlines() if re.match(r"E\s+\w+Error", ln)]
            raise Rejected(
                f"collection fails after removal: {', '.join(run.collect_errors[:3])}"
                + (f" ({errors[-1][1:].strip()})" if errors else "")
            )
        broken = [t for t in visible_p2p if run.outcomes.get(t) != "passed"]
        if broken:
            raise Rejected(
                f"{len(broken)} PASS_TO_PASS test(s) fail after removal, e.g. {broken[0]} "
                f"({run.outcomes.get(broken[0], 'absent')})"
            )

        lap("A_suite")
        # B: hidden tests fail without the feature, consistently
        err = apply_patch(ws, test_patch)
        if err:
            raise Rejected(f"test_patch does not apply: {err}")
        rerun = run_tests(runner, ws, job.venv, timeout=job.timeout, select=hidden_ids, repeat=3)
        runs = [
            {t: (o[i] if i < len(o) else "absent") for t, o in rerun.repeats.items()}
            for i in range(3)
        ]
        git(ws, "reset", "-q", "--hard")
        git(ws, "clean", "-fdxq")
        passed = [{t for t in hidden_ids if r.get(t) == "passed"} for r in runs]
        flaky = sorted((passed[0] | passed[1] | passed[2]) - (passed[0] & passed[1] & passed[2]))
        if flaky:
            raise Rejected(f"{len(flaky)} hidden test(s) flaky after removal, e.g. {flaky[0]}")
        f2p = sorted(set(hidden_ids) - passed[0])
        if not f2p:
            raise Rejected("no hidden test fails after removal")
        p2p = sorted(set(visible_p2p) | passed[0])

        module_text = texts[f.file]
        instance = {
            "instance_id": f"{job.project['name']}-{job.project['version']}__{f.module}.{f.name}",
            "repo": job.project["name"],
            "base_commit": base_commit,
            "patch": gold,
            "test_patch": test_patch,
            "problem_statement": problem_statement(
                f,
                f2p,
                with_signature=job.with_signature,
                exported_from=_exports(texts, f, root, exported),
            ),
            "hints_text": "",
            "created_at": "",
            "FAIL_TO_PASS": f2p,
            "PASS_TO_PASS": p2p,
            "version": job.project["version"],
            "environment_setup_commit": base_commit,
            "environment_setup": {
                "project": job.env_spec.project,
                "version": job.env_spec.version,
                "python": job.env_spec.python,
                "packages": list(job.env_spec.packages),
            },
            "feature": {
                "name": f.name,
                "module": f.module,
                "file": f.file,
                "kind": f.kind,
                "signature": f.defs[0].signature,
                "removed_names": sorted(names),
            },
            "difficulty": {
                **job.difficulty,
                "signature_given": job.with_signature,
                "hidden_tests": len(f2p),
            },
            "provenance": {
                **job.project,
                **remover,
                "files_changed": sorted(lib_changes),
                "tests_changed": sorted(test_changes),
            },
        }

        lap("B_hidden_x3")
        # C, D: gold resolves, stub does not (affected tests only; A ran the rest)
        touched = set(lib_changes)
        affected = sorted(
            {t for r in touched for ids in job.coverage.get(r, {}).values() for t in ids} & set(p2p)
        )
        res = grade_prediction(
            instance,
            job.tar_path,
            gold,
            runner=runner,
            venv=job.venv,
            timeout=job.timeout,
            select=affected,
        )
        if not res["resolved"]:
            raise Rejected(
                f"gold patch does not resolve: {res['failed_tests'][:2]} {res.get('error') or ''}"
            )
        stub = diff_to(
            ws, {**{r: texts[r] for r in lib_changes}, f.file: stub_text(module_text, f)}
        )
        res = grade_prediction(
            instance,
            job.tar_path,
            stub,
            runner=runner,
            venv=job.venv,
            timeout=job.timeout,
            select=[],
        )
        if res["resolved"]:
            raise Rejected("a NotImplementedError stub passes every hidden test")

        lap("C_D_gold_stub")
        # E: no trace of the removed code anywhere the agent can read. Computing patches left
        # the original files as git objects: rebuild the repository (same deterministic commit).
        if init_repo(ws) != base_commit:
            raise Rejected("rebuilding the workspace repository gave a different commit")
        gone = {r for r, t in {**lib_changes, **test_changes}.items() if t is None}
        secret = secret_for(f.defs, module_text, f.module, gone)
        findings = scan_tree(ws, secret)
        findings += scan_tree(site_packages(job.venv), secret, {"cadenza_probe.py"}, env=True)
        if findings:
            raise Rejected(
                f"leak: {findings[0]}"
                + (f" (+{len(findings) - 1} more)" if len(findings) > 1 else "")
            )
        lap("E_leak_scan")
        return instance
    except BaseException:
        job.tar_path.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(ws, ignore_errors=True)
