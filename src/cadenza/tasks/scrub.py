"""Scrub by construction: a workspace is rebuilt from a whitelist into a fresh one-commit repo.

Nothing is deleted from a dirty tree; only whitelisted source files are copied (see
`source.whitelist`), so history, bytecode, type-checker and test caches, egg-info, build
output and editor state never reach the agent. The single commit is deterministic (fixed
author, dates and message), so the same tree always gives the same `base_commit`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from cadenza.tasks.errors import TaskError

GIT_ENV = {
    "GIT_AUTHOR_NAME": "cadenza",
    "GIT_AUTHOR_EMAIL": "tasks@cadenza.invalid",
    "GIT_COMMITTER_NAME": "cadenza",
    "GIT_COMMITTER_EMAIL": "tasks@cadenza.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
}


def git(repo: Path, *args: str, input: str | None = None, check: bool = True) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(repo), **GIT_ENV}
    r = subprocess.run(
        [
            "git",
            "-c",
            "core.hooksPath=/dev/null",
            "-c",
            "commit.gpgsign=false",
            "-c",
            "core.autocrlf=false",
            "-c",
            "core.fileMode=true",
            *args,
        ],
        cwd=repo,
        env=env,
        input=input,
        capture_output=True,
        text=True,
    )
    if check and r.returncode != 0:
        raise TaskError(f"git {' '.join(args[:2])} failed in {repo}: {r.stderr.strip()}")
    return r.stdout


def write_files(dest: Path, files: dict[str, str | bytes | None]) -> None:
    """Write (or delete, for None) files under dest."""
    for rel, data in files.items():
        path = dest / rel
        if data is None:
            path.unlink(missing_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)


def copy_files(src: Path, dest: Path, rels: list[str]) -> None:
    for rel in rels:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dest / rel)


def listed_files(root: Path) -> list[str]:
    """All files under root except .git, as sorted posix paths."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and ".git" not in p.relative_to(root).parts
    )


def init_repo(dest: Path) -> str:
    """Make dest a fresh git repository with one deterministic commit; returns its sha."""
    shutil.rmtree(dest / ".git", ignore_errors=True)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "--allow-empty", "-m", "base")
    return git(dest, "rev-parse", "HEAD").strip()


def diff_to(repo: Path, files: dict[str, str | bytes | None]) -> str:
    """The patch from HEAD to HEAD + files, as `git apply` reads it; the tree is restored."""
    write_files(repo, files)
    try:
        git(repo, "add", "-A")
        return git(repo, "diff", "--cached", "--no-color", "--no-ext-diff", "--binary")
    finally:
        git(repo, "reset", "-q", "--hard")
        git(repo, "clean", "-fdxq")


def apply_patch(repo: Path, patch: str) -> str | None:
    """Apply a patch to the work tree; None on success, else git's complaint."""
    if not patch.strip():
        return None
    env_patch = patch if patch.endswith("\n") else patch + "\n"
    r = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", "-"],
        cwd=repo,
        input=env_patch,
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **GIT_ENV},
    )
    return None if r.returncode == 0 else (r.stderr.strip() or "git apply failed")
