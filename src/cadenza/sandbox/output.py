"""Feeding stdin and reading stdout/stderr of a child together, capped, with a deadline.

One thread, one selector over both output pipes, stdin and the child's pidfd: a child
that fills one pipe while we wait on the other cannot deadlock us, and output beyond the
cap is read and dropped (so the writer never blocks on a full pipe) and flagged.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

CHUNK = 1 << 16
# After the child exits, how long to keep reading pipes that something else still holds
# open (a daemon in unsafe mode); in the sandbox the pid namespace dies with the child.
DRAIN_AFTER_EXIT_S = 0.5


@dataclass
class Captured:
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    stopped: str | None = None  # what `watch` reported when it asked to stop the child


def decode(data: bytes) -> str:
    """UTF-8 with U+FFFD for undecodable bytes (binary output never raises)."""
    return data.decode("utf-8", errors="replace")


def pump(
    proc: subprocess.Popen,
    stdin: bytes | None,
    timeout: float,
    cap: int,
    watch: Callable[[], str | None] | None = None,
    every: float = 0.5,
) -> Captured:
    """Write `stdin`, read both outputs up to `cap` bytes each, until the child has
    exited and its outputs are closed, or `timeout` seconds have passed.

    Returns with `timed_out` set when the deadline passed first, or `stopped` set when
    `watch()` (called every `every` seconds) returned a reason; the caller kills the
    child. The child's pipes are closed on return.
    """
    deadline = time.monotonic() + timeout
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    truncated = False
    exited = False
    sel = selectors.DefaultSelector()
    for fd in (out_fd, err_fd):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ, "out")
    pending = memoryview(stdin or b"")
    if proc.stdin is not None:
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "in")
        else:
            proc.stdin.close()
    pidfd = None
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
    open_outputs = 2
    stopped = None
    next_watch = time.monotonic() + every
    try:
        while open_outputs or not exited:
            now = time.monotonic()
            if watch is not None and now >= next_watch and not exited:
                stopped = watch()
                if stopped is not None:
                    break
                next_watch = now + every
            wait = deadline - now
            if wait <= 0:
                break
            if watch is not None and not exited:
                wait = min(wait, max(0.0, next_watch - now))
            if pidfd is None and not open_outputs:
                try:
                    proc.wait(wait)
                    exited = True
                except subprocess.TimeoutExpired:
                    pass  # the deadline or the next watch: checked at the top
                continue
            for key, _ in sel.select(wait):
                fd = key.fd
                if key.data == "exit":
                    sel.unregister(fd)
                    exited = True
                    deadline = min(deadline, time.monotonic() + DRAIN_AFTER_EXIT_S)
                elif key.data == "in":
                    try:
                        pending = pending[os.write(fd, pending[:CHUNK]) :]
                    except OSError:  # the child closed its stdin
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                else:
                    try:
                        chunk = os.read(fd, CHUNK)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        sel.unregister(fd)
                        open_outputs -= 1
                        continue
                    buf = bufs[fd]
                    room = cap - len(buf)
                    if len(chunk) > room:
                        truncated = True
                    if room > 0:
                        buf += chunk[:room]
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
    # Pipes still open after the child's own exit (a daemon holding them) is no timeout.
    timed_out = stopped is None and not exited and proc.poll() is None
    return Captured(bytes(bufs[out_fd]), bytes(bufs[err_fd]), truncated, timed_out, stopped)
