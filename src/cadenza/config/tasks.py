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
    remover: str = "ast"  # "ast" (exact spans) | "agent" (an OpenAI-compatible chat model)
    endpoint: str = ""  # the agent remover's server, e.g. http://127.0.0.1:8000/v1
    model: str = ""  # the agent remover's model name
    remover_max_turns: int = 40  # model calls per candidate
    remover_max_tokens: int = 100_000  # completion tokens per candidate
    remover_max_seconds: float = 900.0  # wall clock per candidate
