"""The sandbox's contract: what a command sees and returns, checked against plain Python.

Oracles: the same command run by a plain subprocess, Python's own codecs, byte counts of
what the command wrote, and the host filesystem after the run. The attack battery lives
in test_sandbox_security.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

import cadenza.sandbox.bwrap as bw
from cadenza.sandbox import (
    DegradedSandboxWarning,
    Isolation,
    Limits,
    Sandbox,
    SandboxError,
    SandboxUnavailable,
    UnsafeSandboxWarning,
    run,
)
from cadenza.sandbox.output import decode
from sandbox_util import PY, box, host_pids_with, needs_bwrap, py


@pytest.fixture
def ws(tmp_path):
    d = tmp_path / "ws"
    d.mkdir()
    return d


# --- what the command sees -------------------------------------------------------------


@needs_bwrap
def test_same_output_as_plain_subprocess(ws):
    code = "import sys, hashlib; print(hashlib.sha256(b'x' * 1000).hexdigest()); sys.exit(3)"
    plain = subprocess.run([PY, "-I", "-S", "-c", code], capture_output=True, text=True)
    r = py(ws, code)
    assert (r.returncode, r.stdout, r.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert r.sandboxed and not r.timed_out and r.killed_by is None


@needs_bwrap
def test_workspace_at_same_path_and_writable(ws):
    r = py(ws, "import os; print(os.getcwd()); open('made.txt', 'w').write('hi')")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(ws)
    assert (ws / "made.txt").read_text() == "hi"


@needs_bwrap
def test_venv_runs_with_its_packages(ws):
    """A venv given as a ro_bind works unchanged (its base interpreter comes along)."""
    r = box(ws).run([PY, "-c", "import yaml, sys; print(sys.prefix)"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == sys.prefix


@needs_bwrap
def test_clean_environment_and_extra_env(ws, monkeypatch):
    monkeypatch.setenv("HOST_ONLY_VAR", "x")
    r = py(ws, "import os, json; print(json.dumps(dict(os.environ)))", env={"MY_VAR": "1"})
    env = json.loads(r.stdout)
    assert env["MY_VAR"] == "1" and "HOST_ONLY_VAR" not in env
    assert env["HOME"] == bw.HOME and env["LANG"] == "C.UTF-8"
    assert set(env) <= set(bw_default_keys()) | {"MY_VAR", "PWD", "LC_CTYPE"}


def bw_default_keys():
    from cadenza.sandbox.sandbox import default_env

    return default_env().keys()


@needs_bwrap
def test_cwd_inside_workspace(ws):
    (ws / "sub").mkdir()
    r = py(ws, "import os; print(os.getcwd())", cwd=ws / "sub")
    assert r.stdout.strip() == str(ws / "sub")


@needs_bwrap
def test_stdin_is_passed(ws):
    data = os.urandom(300_000)  # larger than a pipe buffer
    r = py(
        ws,
        "import sys, hashlib; print(hashlib.md5(sys.stdin.buffer.read()).hexdigest())",
        stdin=data,
    )
    import hashlib

    assert r.stdout.strip() == hashlib.md5(data).hexdigest()


@needs_bwrap
def test_tmp_and_home_are_private_and_fresh(ws):
    code = "import os; p='/tmp/home/mark'; print(os.path.exists(p)); open(p, 'w').write('x')"
    assert py(ws, code).stdout.strip() == "False"
    assert py(ws, code).stdout.strip() == "False"  # nothing carried over between runs


@needs_bwrap
def test_ro_bind_inside_workspace_stays_read_only(ws):
    (ws / "env").mkdir()
    (ws / "env" / "f").write_text("orig")
    r = py(ws, "open('env/f', 'w').write('changed')", ro_binds=[ws / "env"])
    assert r.returncode != 0 and "Read-only file system" in r.stderr
    assert (ws / "env" / "f").read_text() == "orig"
    assert py(ws, "open('other', 'w').write('ok')").returncode == 0


# --- results: status, timeout, output --------------------------------------------------


@needs_bwrap
def test_exit_status_and_signal_death(ws):
    assert py(ws, "raise SystemExit(7)").returncode == 7
    r = py(ws, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert r.returncode == 128 + 11 and r.killed_by == "SIGSEGV"


@needs_bwrap
def test_timeout_returns_124(ws):
    t0 = time.monotonic()
    r = box(ws, timeout=0.5).run(["sleep", "30"])
    assert r.timed_out and r.returncode == 124 and r.killed_by == "timeout"
    assert 0.5 <= r.duration_s < 10 and time.monotonic() - t0 < 10


@needs_bwrap
def test_output_cap_flags_truncation(ws):
    code = "import sys; sys.stdout.write('a' * 5000); sys.stderr.write('b' * 10)"
    r = py(ws, code, limits=Limits(output_bytes=1000))
    assert r.truncated and r.stdout == "a" * 1000 and r.stderr == "b" * 10
    r = py(ws, code, limits=Limits(output_bytes=5000))
    assert not r.truncated and len(r.stdout) == 5000


@needs_bwrap
def test_non_utf8_output_decodes_like_python(ws):
    blob = bytes(range(256)) * 4 + "é✓".encode() + b"\xff\xfe\xc3"
    r = py(ws, "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read())", stdin=blob)
    assert r.stdout == blob.decode("utf-8", errors="replace")
    assert decode(b"\xc3") == "\ufffd"


@needs_bwrap
def test_both_pipes_full_no_deadlock(ws):
    """Writing megabytes to stderr while stdout also fills must not block the runner."""
    code = (
        "import sys\n"
        "for _ in range(40):\n"
        "    sys.stderr.write('e' * 100000); sys.stderr.flush()\n"
        "    sys.stdout.write('o' * 100000); sys.stdout.flush()\n"
    )
    r = py(ws, code, timeout=20)
    assert r.returncode == 0 and not r.timed_out
    assert len(r.stdout) == len(r.stderr) == 1 << 20 and r.truncated


@needs_bwrap
def test_concurrent_runs(ws):
    sb = box(ws)
    results = [None] * 4

    def go(i):
        results[i] = sb.run([PY, "-I", "-S", "-c", f"print({i} * 2)"])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout.strip() for r in results] == ["0", "2", "4", "6"]


@needs_bwrap
def test_limits_are_applied(ws):
    """The rlimits inside are exactly the configured ones (oracle: the kernel's view)."""
    lim = Limits(cpu_seconds=7, memory_mb=1500, processes=40, file_size_mb=3, open_files=99)
    code = (
        "import resource as r; print([r.getrlimit(x)[1] for x in "
        "(r.RLIMIT_CPU, r.RLIMIT_AS, r.RLIMIT_FSIZE, r.RLIMIT_NOFILE, r.RLIMIT_NPROC, r.RLIMIT_CORE)])"
    )
    r = py(ws, code, limits=lim)
    assert json.loads(r.stdout) == [8, 1500 << 20, 3 << 20, 99, 40, 0]
    r = py(ws, code, memory_mb=700)
    assert json.loads(r.stdout)[1] == 700 << 20


# --- bad input, degraded and unsafe modes ----------------------------------------------


def test_bad_input_errors(tmp_path):
    with pytest.raises(SandboxError, match="expected an existing directory"):
        Sandbox(tmp_path / "missing", unsafe=True)
    with pytest.raises(SandboxError, match="does not exist"):
        Sandbox(tmp_path, ro_binds=[tmp_path / "nope"], unsafe=True)
    sb = Sandbox(tmp_path, unsafe=True)
    with pytest.raises(SandboxError, match="non-empty list"):
        sb.run("echo hi")
    with pytest.raises(SandboxError, match="cwd"):
        sb.run(["true"], cwd="/")
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=0)


def test_missing_bwrap_requires_unsafe(tmp_path, monkeypatch):
    monkeypatch.setattr(
        bw, "probe", lambda: Isolation(None, notes=("bubblewrap is not installed",))
    )
    with pytest.raises(SandboxUnavailable, match="unsafe=True"):
        Sandbox(tmp_path)
    with pytest.warns(UnsafeSandboxWarning):
        r = run(["sh", "-c", "echo $HOME; pwd"], tmp_path, unsafe=True)
    home, cwd = r.stdout.split()
    assert not r.sandboxed and cwd == str(tmp_path) and home != os.environ.get("HOME")


def test_unsafe_mode_timeout_kills_process_group(tmp_path):
    marker = f"cadenza-unsafe-{os.getpid()}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSandboxWarning)
        r = run(
            ["sh", "-c", f"sleep 30 & sleep 31; : {marker}"], tmp_path, timeout=0.5, unsafe=True
        )
    assert r.timed_out and r.returncode == 124
    assert host_pids_with(marker) == []


# --- command line ----------------------------------------------------------------------


def _cli(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "cadenza.cli.main", "sandbox", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # three CLI start-ups (~1 s each on an idle 2-core machine)
@needs_bwrap
def test_cli_run_passes_status_and_output(ws):
    r = _cli("run", "--workspace", str(ws), "--", "sh", "-c", "echo out; echo err >&2; exit 5")
    assert (r.returncode, r.stdout, r.stderr) == (5, "out\n", "err\n")
    r = _cli("run", "--workspace", str(ws), "--timeout", "0.5", "--", "sleep", "10")
    assert r.returncode == 124 and "timed out" in r.stderr


@needs_bwrap
def test_cli_check_reports_isolation():
    r = _cli("check")
    assert r.returncode == 0 and "net" in r.stdout


def test_cli_unsafe_warns(tmp_path):
    r = _cli("run", "--workspace", str(tmp_path), "--unsafe", "--", "true")
    assert r.returncode == 0 and "WITHOUT a sandbox" in r.stderr
    r = _cli("run", "--workspace", str(tmp_path / "no"), "--", "true")
    assert r.returncode == 2 and "expected an existing directory" in r.stderr


@needs_bwrap
def test_from_config(ws):
    from cadenza.config import load_config

    cfg = load_config("tiny", ["sandbox.memory_mb=900", "sandbox.timeout=0.5"]).sandbox
    sb = Sandbox.from_config(ws, cfg)
    assert sb.limits.memory_mb == 900 and sb.timeout == 0.5
    assert sb.run(["sleep", "5"]).timed_out


@pytest.mark.parametrize(
    "machine, header",
    [
        ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
        ("aarch64", "/usr/include/asm-generic/unistd.h"),
    ],
)
def test_seccomp_numbers_match_kernel_headers(machine, header):
    """The filter's syscall tables agree with the installed kernel headers (the oracle)."""
    import re

    from cadenza.sandbox import seccomp

    if not os.path.exists(header):
        pytest.skip(f"{header} not installed")
    defined = dict(
        (m.group(1), int(m.group(2)))
        for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", open(header).read())
    )
    table = seccomp.ARCHES[machine][1]
    assert {k: defined.get(k) for k in table} == table
    assert set(seccomp.BLOCKED) - set(table) <= {"iopl", "ioperm"}  # x86-only calls
    prog = seccomp.filter_program(machine)
    assert len(prog) % 8 == 0 and len(prog) // 8 < 256


def _fake_bwrap(tmp_path, refuse: str) -> str:
    """A bwrap that refuses one option, as a kernel or policy without that namespace would."""
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do [ "$a" = "{refuse}" ] && {{ echo "bwrap: not permitted" >&2; exit 1; }}; done\n'
        f'exec {shutil.which("bwrap")} "$@"\n'
    )
    fake.chmod(0o755)
    return str(fake)


@needs_bwrap
def test_degrades_explicitly_without_ipc_namespace(ws, tmp_path, monkeypatch):
    """A namespace the machine refuses is dropped, reported, warned about, and really absent."""
    iso = bw.probe.__wrapped__(_fake_bwrap(tmp_path, "--unshare-ipc"))
    assert iso.available and iso.missing == ("ipc",)
    assert any("ipc namespace" in n for n in iso.notes)
    monkeypatch.setattr(bw, "probe", lambda: iso)
    code = "import os; print(os.readlink('/proc/self/ns/ipc'), os.readlink('/proc/self/ns/net'))"
    with pytest.warns(DegradedSandboxWarning, match="ipc"):
        r = py(ws, code)
    ipc, net = r.stdout.split()
    assert ipc == os.readlink("/proc/self/ns/ipc")  # shared with the host, as reported
    assert net != os.readlink("/proc/self/ns/net")


@needs_bwrap
def test_unavailable_without_network_namespace(tmp_path, monkeypatch):
    iso = bw.probe.__wrapped__(_fake_bwrap(tmp_path, "--unshare-net"))
    assert not iso.available and "network" in " ".join(iso.notes)
    monkeypatch.setattr(bw, "probe", lambda: iso)
    with pytest.raises(SandboxUnavailable, match="unsafe"):
        Sandbox(tmp_path)


def test_inside_resolves_like_the_host(tmp_path):
    """inside() agrees with os.path.realpath (the oracle) and refuses what leaves the root."""
    from cadenza.sandbox import PathEscape, inside

    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "alias").symlink_to("pkg")
    (ws / "out").symlink_to(tmp_path)
    assert inside(ws, "pkg/a.py") == Path(os.path.realpath(ws / "pkg/a.py"))
    assert inside(ws, "alias/a.py") == ws.resolve() / "pkg" / "a.py"
    assert inside(ws, ws / "pkg") == ws.resolve() / "pkg"
    assert inside(ws, ".") == ws.resolve()
    assert inside(ws, "out/ws/pkg") == ws.resolve() / "pkg"  # out and back in: fine
    for bad in ("..", "../ws2/x", "out", "out/secret", "/etc/passwd", "pkg/../../x"):
        with pytest.raises(PathEscape, match="outside the workspace"):
            inside(ws, bad)


def test_sandbox_does_not_import_torch():
    code = "import sys, cadenza.sandbox, cadenza.cli.sandbox; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "False", r.stderr
