"""Acceptance on real PyPI projects (sdists cached under .cache/): the build yields valid
tasks, and for every task the gold patch resolves it while an empty patch and a patch that
deletes or skips the hidden tests do not."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cadenza.tasks.build import BuildOptions, build
from cadenza.tasks.grade import grade_prediction
from cadenza.tasks.store import export, read_tasks

PROJECTS = {
    "pypi:inflection==0.5.1": {},
    # toolz reads its version from installed metadata, which a workspace never has
    "pypi:toolz==1.2.0": {"exclude_failing": True},
    "pypi:tabulate==0.10.0": {},
}


def _cheat(out: Path, task: dict, tmp: Path) -> str:
    """Deletes the files the hidden tests live in and skips every test from a conftest.py."""
    ws = tmp / "cheat"
    export(out, task["instance_id"], ws)
    for rel in {t.split("::")[0] for t in task["FAIL_TO_PASS"]}:
        (ws / rel).unlink(missing_ok=True)
    (ws / "conftest.py").write_text(
        "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
        "    for item in items:\n        item.add_marker(pytest.mark.skip)\n"
    )
    subprocess.run(["git", "add", "-A"], cwd=ws, check=True)
    return subprocess.run(
        ["git", "diff", "--cached"], cwd=ws, check=True, capture_output=True, text=True
    ).stdout


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.parametrize("source", list(PROJECTS))
def test_real_project_tasks_are_valid(source, tmp_path):
    out = tmp_path / "tasks"
    opts = BuildOptions(max_tasks=2, max_candidates=4, workers=2, timeout=300, **PROJECTS[source])
    summary = build(source, out, opts, log=print)
    print(source, "accepted", summary["accepted"], "rejected", summary["rejection_reasons"])
    tasks = read_tasks(out)
    assert len(tasks) >= 1
    for task in tasks:
        tar = out / "workspaces" / f"{task['instance_id']}.tar"
        assert task["FAIL_TO_PASS"] and task["PASS_TO_PASS"]
        assert grade_prediction(task, tar, task["patch"], timeout=300)["resolved"]
        assert not grade_prediction(task, tar, "", timeout=300)["resolved"]
        r = grade_prediction(
            task, tar, _cheat(out, task, tmp_path / task["instance_id"]), timeout=300
        )
        assert not r["resolved"] and "conftest.py" in r["dropped_paths"]
