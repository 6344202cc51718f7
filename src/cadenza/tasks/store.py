"""The task store: DIR/tasks.jsonl (one SWE-bench-style instance per line), the agent's
starting workspaces (DIR/workspaces/<instance_id>.tar) and the build log.

A directory is written under a temporary name and renamed into place when complete, so a
failed build leaves nothing behind. Every line of tasks.jsonl has the same keys and types
(loadable with `datasets`).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from cadenza.tasks.errors import TaskError
from cadenza.tasks.scrub import init_repo, listed_files

SWE_FIELDS = (
    "instance_id",
    "repo",
    "base_commit",
    "patch",
    "test_patch",
    "problem_statement",
    "hints_text",
    "created_at",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "version",
    "environment_setup_commit",
    "environment_setup",
)
CADENZA_FIELDS = ("feature", "difficulty", "provenance")


def pack_workspace(root: Path, dest: Path) -> None:
    """Tar the files of a workspace (not .git), deterministic order and metadata."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for rel in listed_files(root):
            info = tar.gettarinfo(str(root / rel), arcname=rel)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 946684800
            with open(root / rel, "rb") as f:
                tar.addfile(info, f)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(buf.getvalue())


def unpack_workspace(tar_path: Path, dest: Path) -> None:
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")


def read_tasks(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / "tasks.jsonl"
    if not path.exists():
        raise TaskError(
            f"{out_dir}: no tasks.jsonl here; expected a directory written by `cadenza tasks build`"
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def find_task(out_dir: Path, instance_id: str) -> dict[str, Any]:
    tasks = read_tasks(out_dir)
    for t in tasks:
        if t["instance_id"] == instance_id:
            return t
    ids = ", ".join(t["instance_id"] for t in tasks[:5])
    raise TaskError(f"{out_dir}: no instance {instance_id!r}; it has {len(tasks)}, e.g. {ids}")


def check_schema(tasks: list[dict[str, Any]]) -> None:
    """Every instance has the same keys with the same value types (a columnar table)."""
    if not tasks:
        return
    shape = {k: type(v).__name__ for k, v in tasks[0].items()}
    for t in tasks[1:]:
        other = {k: type(v).__name__ for k, v in t.items()}
        if other != shape:
            raise TaskError(f"instance {t['instance_id']}: fields {other} differ from {shape}")


def export(out_dir: Path, instance_id: str, to: Path) -> str:
    """Materialize the agent's starting workspace at `to` (one commit = base_commit)."""
    task = find_task(out_dir, instance_id)
    if to.exists() and any(to.iterdir()):
        raise TaskError(f"{to}: exists and is not empty; expected a new or empty directory")
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=to.parent))
    try:
        unpack_workspace(out_dir / "workspaces" / f"{instance_id}.tar", tmp)
        sha = init_repo(tmp)
        if sha != task["base_commit"]:
            raise TaskError(
                f"{instance_id}: rebuilt workspace has commit {sha}, expected {task['base_commit']}; "
                "the task directory was modified: rebuild it"
            )
        if to.exists():
            to.rmdir()
        os.replace(tmp, to)
        return sha
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
