"""Task-building config: how many tasks, how hard, how they are validated."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TasksConfig:
    sources: list[str] = field(default_factory=list)  # pypi:NAME[==VERSION] or directories
    out_dir: str = "tasks"
    max_tasks: int = 10  # per source
    max_candidates: int = 0  # candidates tried per source; 0 = 4 x max_tasks
    workers: int = 1  # validation processes (capped at 2 on this machine)
    difficulty: str = "any"  # "easy" | "medium" | "hard" | "any"
    timeout: float = 600.0  # seconds per test-suite run
    with_signature: bool = True  # give the removed symbol's signature in the statement
    exclude_failing: bool = False  # leave out tests failing in the original suite
    sandbox: bool = False  # build-time gates in the sandbox too (grading always uses it)
