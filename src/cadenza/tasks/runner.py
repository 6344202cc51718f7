"""How tasks run commands: a small `Runner` protocol and a plain-subprocess implementation.

Everything in cadenza.tasks that executes project code (test suites, coverage, git) goes
through a Runner, so grading can switch to the bubblewrap sandbox without touching callers.
`SubprocessRunner` starts each command in its own process group; on timeout the whole group
is killed (a hanging test cannot leave grandchildren behind), and output is capped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float


class Runner(Protocol):
    def run(
        self,
        argv: list[str],
        workspace: Path,
        *,
        timeout: float,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        ro_binds: Sequence[Path] = (),
    ) -> RunResult: ...


def _cap(data: bytes, limit: int) -> str:
    text = data.decode("utf-8", "replace")
    if len(text) <= limit:
        return text
    half = limit // 2
    return text[:half] + f"\n... [{len(text) - limit} characters cut] ...\n" + text[-half:]


@dataclass
class SubprocessRunner:
    """Runs argv as a plain subprocess (no isolation beyond a process group)."""

    output_limit: int = 200_000

    def run(
        self,
        argv: list[str],
        workspace: Path,
        *,
        timeout: float,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        ro_binds: Sequence[Path] = (),
    ) -> RunResult:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv,
            cwd=cwd or workspace,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
        return RunResult(
            returncode=proc.returncode,
            stdout=_cap(out, self.output_limit),
            stderr=_cap(err, self.output_limit),
            timed_out=timed_out,
            duration_s=time.monotonic() - t0,
        )


def default_runner() -> Runner:
    return SubprocessRunner()
