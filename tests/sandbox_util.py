"""Helpers shared by the sandbox tests: this interpreter inside the sandbox, host probes."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from cadenza.sandbox import Sandbox, isolation

PY = sys.executable
# The test interpreter's venv (and its base install when outside /usr), read-only inside.
PY_BINDS = sorted(
    {Path(p) for p in (sys.prefix, sys.base_prefix) if p != "/usr" and not p.startswith("/usr/")}
)

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None or not isolation().available,
    reason="bubblewrap cannot isolate on this machine (see cadenza.sandbox.isolation())",
)


def box(workspace: Path, **kw) -> Sandbox:
    kw.setdefault("timeout", 30)
    binds = list(kw.pop("ro_binds", ())) + PY_BINDS
    return Sandbox(workspace, ro_binds=binds, **kw)


def py(workspace: Path, code: str, **kw):
    """Run Python `code` in a sandbox over `workspace` (isolated mode, no site: quick)."""
    run_kw = {k: kw.pop(k) for k in ("stdin", "cwd", "env") if k in kw}
    return box(workspace, **kw).run([PY, "-I", "-S", "-c", code], **run_kw)


def host_pids_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (leftovers of a sandboxed run)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out
