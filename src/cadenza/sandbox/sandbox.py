"""Run one command in isolation: `run(argv, workspace)` and the reusable `Sandbox`.

Launch: the runner spawns `bwrap --info-fd A --block-fd B LAYOUT -- argv` directly (a
vfork-cheap spawn, no wrapper processes, no preexec in a large trainer process). bwrap
creates the namespaces, reports its sandbox's pid 1 on A and parks it on B before any of
the command runs; the runner sets the rlimits on that pid (prlimit(2)) and moves it into
a fresh pids cgroup, then releases it. Everything the command starts descends from that
pid 1 and inherits both.

Timeout: the runner SIGKILLs bwrap; `--die-with-parent` then kills the sandbox's pid-1,
and the kernel kills every process of the pid namespace with it (double-forked daemons
included); the cgroup, when there is one, is emptied as a last sweep.

Exit status follows the shell: 128+N when the command died of signal N, 124 when the
wall-clock timeout ended it (as timeout(1) does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cadenza.sandbox import bwrap as bw
from cadenza.sandbox import cgroup
from cadenza.sandbox.disk import DiskWatch
from cadenza.sandbox.limits import (
    RLIMIT,
    Limits,
    MiB,
    apply_rlimits,
    cgroup_limits,
    prlimit_argv,
    rlimits,
)
from cadenza.sandbox.output import decode, pump

TIMEOUT_STATUS = 124
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SandboxError(RuntimeError):
    """A sandbox that cannot be set up as asked (bad workspace, bad path, ...)."""


class SandboxUnavailable(SandboxError):
    """bubblewrap is missing or cannot isolate here, and `unsafe` was not given."""


class UnsafeSandboxWarning(UserWarning):
    """A command runs without isolation (explicit `unsafe=True` / `--unsafe`)."""


class DegradedSandboxWarning(UserWarning):
    """The sandbox runs, but this machine cannot isolate some things (see the message)."""


@dataclass(frozen=True)
class SandboxResult:
    returncode: int  # 128+N for death by signal N; 124 on timeout
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    truncated: bool  # stdout or stderr went past Limits.output_bytes; the rest was dropped
    killed_by: str | None  # "timeout", "memory" (OOM in the sandbox's cgroup), "disk"
    # (Limits.disk_mb), or the signal's name ("SIGXCPU", "SIGXFSZ", "SIGKILL", ...)
    sandboxed: bool = True  # False when run with unsafe=True

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def default_env(home: str = bw.HOME) -> dict[str, str]:
    """The whole environment a command starts with; nothing is inherited from the host."""
    return {
        "PATH": SAFE_PATH,
        "HOME": home,
        "USER": bw.USER,
        "LOGNAME": bw.USER,
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",
        "TERM": "dumb",
        "SHELL": "/bin/sh",
    }


def _signal_name(status: int) -> str | None:
    if status <= 128:
        return None
    try:
        return signal.Signals(status - 128).name
    except ValueError:
        return None


def _checked_env(env: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for key, value in env.items():
        key, value = str(key), str(value)
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise SandboxError(
                f"env: {key!r}: expected a name without '=' or NUL and a value without NUL"
            )
        out[key] = value
    return out


_warned: set[str] = set()


def _warn_once(message: str, category: type[Warning]) -> None:
    # warnings.warn already de-duplicates per call site; this also tells CLI users on stderr.
    if message not in _warned:
        _warned.add(message)
        print(f"cadenza.sandbox: warning: {message}", file=sys.stderr)
    warnings.warn(message, category, stacklevel=3)


class Sandbox:
    """A workspace and its limits, for running many commands the same way.

    `Sandbox(ws).run(["python", "-m", "pytest"])` runs the command in `ws` (seen at the
    same absolute path, the only writable place besides a private /tmp), with no network,
    no host secrets, a clean environment and the limits in `limits`.
    """

    def __init__(
        self,
        workspace: Path | str,
        *,
        timeout: float = 60,
        memory_mb: int | None = None,
        env: Mapping[str, str] | None = None,
        ro_binds: Sequence[Path | str] = (),
        unsafe: bool = False,
        limits: Limits | None = None,
    ) -> None:
        ws = Path(workspace).absolute()
        if not ws.is_dir():
            raise SandboxError(
                f"workspace {ws}: expected an existing directory, found "
                f"{'a file' if ws.exists() else 'nothing'}; create it or pass another path"
            )
        binds = []
        for p in ro_binds:
            q = Path(p).absolute()
            if not q.exists():
                raise SandboxError(
                    f"ro_binds: {q} does not exist; expected paths to show read-only "
                    "inside the sandbox (e.g. a task's venv)"
                )
            binds.append(q)
        if timeout <= 0:
            raise SandboxError(f"timeout: expected seconds > 0, found {timeout!r}")
        limits = limits or Limits()
        if memory_mb is not None:
            limits = dataclasses.replace(limits, memory_mb=memory_mb)
        self.workspace = ws
        self.timeout = float(timeout)
        self.env = dict(env or {})
        self.limits = limits
        self.unsafe = unsafe
        self.isolation = None if unsafe else bw.probe()
        if self.isolation is not None and not self.isolation.available:
            raise SandboxUnavailable(
                "cannot sandbox: "
                + "; ".join(self.isolation.notes)
                + ". Install bubblewrap (`make system-deps`, or apt-get install bubblewrap) "
                "on a kernel that allows user namespaces, or pass unsafe=True / --unsafe "
                "to run WITHOUT isolation"
            )
        # A venv among the binds (or in the workspace) needs its base interpreter, too.
        self.ro_binds = binds + [
            p for p in bw.venv_interpreters([ws, *binds]) if p not in binds and p != ws
        ]
        self._prlimit = shutil.which("prlimit")

    @classmethod
    def from_config(cls, workspace: Path | str, cfg, **kw) -> Sandbox:
        """A sandbox from a `cadenza.config.sandbox.SandboxConfig` (keywords override it)."""
        fields = {f.name for f in dataclasses.fields(Limits)}
        limits = Limits(**{k: v for k, v in vars(cfg).items() if k in fields})
        kw = {"timeout": cfg.timeout, "unsafe": cfg.unsafe, "limits": limits, **kw}
        return cls(workspace, **kw)

    def _visible(self, path: Path) -> bool:
        return any(path == r or r in path.parents for r in [self.workspace, *self.ro_binds])

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        cwd: Path | str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> SandboxResult:
        """Run `argv` to completion or timeout; never raises for anything the command does."""
        if isinstance(argv, (str, bytes)) or not argv:
            raise SandboxError(
                f"argv: expected a non-empty list of strings, found {argv!r}; "
                'for a shell line use ["sh", "-c", line]'
            )
        argv = [str(a) for a in argv]
        timeout = self.timeout if timeout is None else float(timeout)
        if timeout <= 0:
            raise SandboxError(f"timeout: expected seconds > 0, found {timeout!r}")
        wd = self.workspace if cwd is None else Path(cwd).absolute()
        if not self._visible(wd):
            raise SandboxError(
                f"cwd {wd}: expected the workspace {self.workspace} or a path inside it "
                "(or inside a ro_bind)"
            )
        if self.unsafe:
            return self._run_unsafe(argv, wd, timeout, env, stdin)
        return self._run_bwrap(argv, wd, timeout, env, stdin)

    def _limit_prefix(self, timeout: float) -> tuple[list[str], dict]:
        """Unsandboxed runs: prlimit(1) in front of the command (preexec as a fallback)."""
        rl = rlimits(self.limits, timeout)
        if self._prlimit:
            return prlimit_argv(self._prlimit, rl), {}
        return [], {"preexec_fn": lambda: apply_rlimits(rl)}

    def _run_bwrap(self, argv, wd, timeout, env, stdin) -> SandboxResult:
        iso = self.isolation
        for note in iso.notes:
            _warn_once(f"sandbox degraded: {note}", DegradedSandboxWarning)
        # The command's environment travels as bwrap options, not as bwrap's own: bwrap
        # runs with host privileges until it enters the namespaces, so LD_PRELOAD and the
        # like must never reach it.
        full_env = _checked_env({**default_env(), **self.env, **(env or {})})
        wanted = cgroup_limits(self.limits)
        if "cpu" in wanted and "cpu" not in iso.cgroups:
            _warn_once(
                "sandbox degraded: no writable cpu cgroup, Limits.cpus is not applied",
                DegradedSandboxWarning,
            )
        leaves, notes = cgroup.create({k: v for k, v in wanted.items() if k in iso.cgroups})
        for note in notes:
            _warn_once(f"sandbox degraded: {note}", DegradedSandboxWarning)
        layout = bw.bwrap_argv(
            iso, self.workspace, self.ro_binds, wd, self.limits.tmp_mb, self.limits.shm_mb
        )
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        child_fds = [info_w, block_r]
        cmd = [layout[0], "--info-fd", str(info_w), "--block-fd", str(block_r)]
        filt = bw.seccomp_fd() if iso.seccomp else None
        if filt is not None:
            child_fds.append(filt)
            cmd += ["--seccomp", str(filt)]
        cmd += ["--clearenv"]
        for key, value in full_env.items():
            cmd += ["--setenv", key, value]
        cmd += layout[1:]
        limits = rlimits(self.limits, timeout)

        def confine(pid: int) -> None:
            # bwrap reports its sandbox's pid 1 on --info-fd, then parks it on --block-fd
            # before anything of the command runs: limit and enrol it, then let it go.
            confine_parked(pid, info_r, block_w, limits, leaves, timeout)

        try:
            result = self._spawn(
                [*cmd, *argv],
                None,
                {"PATH": SAFE_PATH},
                timeout,
                stdin,
                True,
                {"pass_fds": tuple(child_fds)},
                after_start=lambda: [os.close(fd) for fd in child_fds],
                confine=confine,
            )
            if result.killed_by == "SIGKILL" and leaves.oom_killed():
                result = dataclasses.replace(result, killed_by="memory")
            return result
        finally:
            os.close(info_r)
            os.close(block_w)
            leaves.destroy()

    def _run_unsafe(self, argv, wd, timeout, env, stdin) -> SandboxResult:
        _warn_once(
            "running WITHOUT a sandbox (unsafe=True): the command sees the host's files, "
            "network and processes; only rlimits and the timeout apply",
            UnsafeSandboxWarning,
        )
        prefix, extra = self._limit_prefix(timeout)
        home = tempfile.mkdtemp(prefix="cadenza-unsafe-home-")
        try:
            full_env = _checked_env({**default_env(home), **self.env, **(env or {})})
            return self._spawn([*prefix, *argv], wd, full_env, timeout, stdin, False, extra)
        finally:
            shutil.rmtree(home, ignore_errors=True)

    def _spawn(
        self, cmd, wd, env, timeout, stdin, sandboxed, extra, after_start=None, confine=None
    ) -> SandboxResult:
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=wd,
                env=env,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                **extra,
            )
        except OSError as e:
            if after_start is not None:
                after_start()
            return SandboxResult(
                127, "", f"cannot run {cmd[0]!r}: {e}\n", False, 0.0, False, None, sandboxed
            )
        try:
            if after_start is not None:
                after_start()
            if confine is not None:
                confine(proc.pid)
            disk = DiskWatch(self.workspace, self.limits.disk_mb * MiB)
            cap = pump(
                proc,
                stdin,
                max(0.0, timeout - (time.monotonic() - t0)),
                self.limits.output_bytes,
                watch=disk.check,
            )
        finally:
            if proc.poll() is None:
                # Whole group: unsandboxed children share it; bwrap's namespace dies with it.
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
        if not sandboxed:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group
        duration = time.monotonic() - t0
        status = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        if cap.timed_out:
            status, killed_by = TIMEOUT_STATUS, "timeout"
        elif cap.stopped is not None:
            killed_by = cap.stopped
        else:
            killed_by = _signal_name(status)
        return SandboxResult(
            status,
            decode(cap.stdout),
            decode(cap.stderr),
            cap.timed_out,
            duration,
            cap.truncated,
            killed_by,
            sandboxed,
        )


def confine_parked(
    bwrap_pid: int,
    info_fd: int,
    block_fd: int,
    limits: dict[str, tuple[int, int]],
    leaves: cgroup.Leaves,
    timeout: float,
) -> None:
    """Set rlimits on, and move into the pids cgroup, the sandbox's pid 1 parked by bwrap.

    Everything the command starts descends from that pid 1, so it inherits both. If bwrap
    fails before reporting (a bad mount, say), there is nothing to confine and its own
    error reaches stderr. If confining fails, the sandbox is killed, never released.
    """
    data = b""
    deadline = time.monotonic() + min(timeout, 30.0)
    while not data.endswith(b"}\n"):
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([info_fd], [], [], wait)[0]:
            break
        chunk = os.read(info_fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        child = json.loads(data)["child-pid"]
    except (ValueError, KeyError):
        return  # bwrap ended before starting a sandbox; it reports why on stderr
    try:
        for name, value in limits.items():
            resource.prlimit(child, RLIMIT[name], value)
        leaves.enrol(child)
    except ProcessLookupError:
        return
    except OSError as e:
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
            os.kill(bwrap_pid, signal.SIGKILL)
        raise SandboxError(f"cannot confine the sandbox (rlimits/cgroup): {e}") from e
    with contextlib.suppress(OSError):
        os.write(block_fd, b"1")


def run(
    argv: Sequence[str],
    workspace: Path | str,
    *,
    timeout: float = 60,
    memory_mb: int | None = None,
    env: Mapping[str, str] | None = None,
    ro_binds: Sequence[Path | str] = (),
    cwd: Path | str | None = None,
    unsafe: bool = False,
    limits: Limits | None = None,
    stdin: bytes | None = None,
) -> SandboxResult:
    """Run `argv` in a sandbox over `workspace` (see `Sandbox`)."""
    box = Sandbox(
        workspace,
        timeout=timeout,
        memory_mb=memory_mb,
        env=env,
        ro_binds=ro_binds,
        unsafe=unsafe,
        limits=limits,
    )
    return box.run(argv, cwd=cwd, stdin=stdin)
