"""Tasks for the runner from a task store (`cadenza tasks build ... --out DIR`).

Each instance of DIR/tasks.jsonl becomes an `AgentTask`: its workspace is the store's export
(one commit, the removed feature's tests absent), its visible tests run with the instance's
environment (a virtualenv the task factory builds and caches), and a patch is graded by the
task factory's grader in a fresh workspace with the pristine tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cadenza.agent.runner import AgentTask, GradeResult


def _grader(store: Path, task: dict[str, Any], timeout: float):
    def grade(patch: str) -> GradeResult:
        from cadenza.tasks.grade import grade_prediction

        tar = store / "workspaces" / f"{task['instance_id']}.tar"
        r = grade_prediction(task, tar, patch, timeout=timeout)
        return GradeResult(bool(r.get("resolved")), float(bool(r.get("resolved"))), r)

    return grade


def load_task_store(
    store: str | Path, instance_ids: list[str] | None = None, grade_timeout: float = 600
) -> list[AgentTask]:
    """The store's instances (all, or those named) as AgentTasks."""
    from cadenza.tasks.environment import EnvSpec, ensure_venv
    from cadenza.tasks.source import default_cache_dir, import_root
    from cadenza.tasks.store import export, read_tasks

    store = Path(store)
    rows = read_tasks(store)
    if instance_ids:
        known = {t["instance_id"] for t in rows}
        missing = [i for i in instance_ids if i not in known]
        if missing:
            raise ValueError(f"{store}: no instances {missing[:5]}; it has {sorted(known)[:5]}...")
        rows = [t for t in rows if t["instance_id"] in set(instance_ids)]
    out = []
    for t in rows:
        venv = ensure_venv(EnvSpec(**t["environment_setup"]), default_cache_dir())

        env = {
            "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONDONTWRITEBYTECODE": "1",
            "LANG": "C.UTF-8",
        }
        task = AgentTask(
            t["instance_id"],
            t.get("problem_statement", ""),
            lambda ws: None,
            grade=_grader(store, t, grade_timeout),
            test_command=(
                str(venv / "bin" / "python"),
                "-m",
                "pytest",
                "-q",
                "-x",
                "-p",
                "no:cacheprovider",
            ),
            env=env,
            ro_binds=(str(venv),),
        )

        def prepare(ws: Path, _id: str = t["instance_id"], _env: dict = env) -> None:
            export(store, _id, ws)
            # Relative: the sandbox may mount the workspace elsewhere; commands run in it.
            _env["PYTHONPATH"] = str(import_root(ws))

        task.prepare_workspace = prepare
        out.append(task)
    return out
