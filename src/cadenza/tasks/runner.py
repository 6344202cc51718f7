"""How tasks run commands: a small `Runner` protocol and a plain-subprocess implementation.

Everything in cadenza.tasks that executes project code (test suites, coverage) goes
through a Runner. `SandboxRunner` runs it in cadenza.sandbox (bubblewrap: no network, only
the workspace writable, the environment read-only): the default for grading, where the code
under test is a model's. `SubprocessRunner` starts each command in its own process group;
on timeout the whole group is killed (a hanging test cannot leave grandchildren behind), and
output is capped: the default for build-time gates, which run the project's own code.
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


@dataclass
class SandboxRunner:
    """Runs argv in cadenza.sandbox; ro_binds (the project's environment) are read-only."""

    memory_mb: int | None = None
    unsafe: bool = False

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
        from cadenza.sandbox import run as sandbox_run

        r = sandbox_run(
            argv,
            workspace,
            timeout=timeout,
            memory_mb=self.memory_mb,
            env=env,
            ro_binds=list(ro_binds),
            cwd=cwd,
            unsafe=self.unsafe,
        )
        return RunResult(r.returncode, r.stdout, r.stderr, r.timed_out, r.duration_s)


def default_runner() -> Runner:
    """For build-time gates: the project's own code, run as a plain subprocess."""
    return SubprocessRunner()


def grading_runner() -> Runner:
    """For grading predictions: the sandbox when this machine can isolate, else a subprocess
    (with a warning on stderr, once)."""
    from cadenza.sandbox import isolation

    if isolation().available:
        return SandboxRunner()
    global _warned
    if not _warned:
        import sys

        print(
            "cadenza.tasks: warning: no sandbox here (bubblewrap unavailable); grading runs "
            "predictions as plain subprocesses",
            file=sys.stderr,
        )
        _warned = True
    return SubprocessRunner()


_warned = False
