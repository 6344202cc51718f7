"""Security battery: attacks run through the sandbox, each asserted contained.

Each test's docstring reads "attack. Contained: how". The oracle is always the HOST: a real
listener that must see no connection, host files that must be unchanged or unread, host
processes that must survive, leftover processes that must not exist after the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from cadenza.sandbox import Limits
from sandbox_util import PY, box, host_pids_with, needs_bwrap, py

pytestmark = needs_bwrap

SECRET = "s3cr3t-" + uuid.uuid4().hex


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A workspace, a host secret and a host copy of the project beside it, a secret env var."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "token").write_text(SECRET)
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "solution.py").write_text(f"ANSWER = {SECRET!r}\n")
    monkeypatch.setenv("CADENZA_TEST_SECRET", SECRET)
    return tmp_path


def attack(ws: Path, code: str, **kw):
    """Run attack `code` (Python); it prints a JSON verdict on its last stdout line."""
    r = py(ws, textwrap.dedent(code), **kw)
    return r, (json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None)


def errno_of(call: str) -> str:
    """Python source: run `call`, print the errno name it failed with, or "OK"."""
    return textwrap.dedent(
        f"""
        import errno, json
        try:
            {call}
            print(json.dumps("OK"))
        except OSError as e:
            print(json.dumps(errno.errorcode.get(e.errno, str(e))))
        """
    )


# --- network ------------------------------------------------------------------------------


def test_tcp_to_host_loopback_listener(host):
    """TCP connect to a real listener on the host's 127.0.0.1. Contained: own network namespace (its loopback is not the host's): ECONNREFUSED, the listener accepts nothing."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    r, verdict = attack(
        host / "ws",
        errno_of(f"__import__('socket').create_connection(('127.0.0.1', {port}), timeout=2)"),
    )
    assert verdict == "ECONNREFUSED", r
    with pytest.raises(TimeoutError):
        srv.accept()
    srv.close()


def test_udp_to_host_loopback_listener(host):
    """UDP datagram to a real host UDP socket on 127.0.0.1. Contained: own network namespace; the host socket receives nothing."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.bind(("127.0.0.1", 0))
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    code = f"""
        import socket, json
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(5):
            s.sendto(b"leak", ("127.0.0.1", {port}))
        print(json.dumps("sent"))
    """
    attack(host / "ws", code)
    with pytest.raises(TimeoutError):
        srv.recvfrom(100)
    srv.close()


def test_tcp_to_internet(host):
    """TCP connect to a public address (1.1.1.1:443). Contained: no interface but loopback: ENETUNREACH."""
    r, verdict = attack(
        host / "ws", errno_of("__import__('socket').create_connection(('1.1.1.1', 443), timeout=3)")
    )
    assert verdict == "ENETUNREACH", r


def test_udp_to_internet(host):
    """UDP datagram to a public DNS server (8.8.8.8:53). Contained: no route: ENETUNREACH."""
    call = "__import__('socket').socket(2, 2).sendto(b'x', ('8.8.8.8', 53))"
    r, verdict = attack(host / "ws", errno_of(call))
    assert verdict == "ENETUNREACH", r


def test_dns_lookup(host):
    """DNS lookup of pypi.org. Contained: no resolv.conf, no network: the lookup fails."""
    code = """
        import socket, json
        try:
            socket.getaddrinfo("pypi.org", 443)
            print(json.dumps("resolved"))
        except socket.gaierror as e:
            print(json.dumps("failed"))
    """
    r, verdict = attack(host / "ws", code)
    assert verdict == "failed", r


def test_only_loopback_interface(host):
    """List network interfaces to find a way out. Contained: the namespace has only `lo`."""
    r, verdict = attack(
        host / "ws", "import socket, json; print(json.dumps([n for _, n in socket.if_nameindex()]))"
    )
    assert verdict == ["lo"], r


def test_host_abstract_unix_socket(host):
    """Connect to a host abstract-namespace unix socket (how X11/dbus leak). Contained: abstract sockets belong to the network namespace: ECONNREFUSED."""
    name = f"\0cadenza-test-{uuid.uuid4().hex}"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(name)
    srv.listen()
    call = f"__import__('socket').socket(1).connect({name!r})"
    r, verdict = attack(host / "ws", errno_of(call))
    srv.close()
    assert verdict == "ECONNREFUSED", r


# --- writes outside the workspace ---------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    ["/evil", "/etc/passwd", "/etc/evil", "/usr/bin/evil", "/usr/lib/evil.so", "/dev/evil"],
)
def test_write_system_paths(host, target):
    """Write into /, /etc, /usr, /dev. Contained: read-only mounts (/ is remounted read-only): EROFS."""
    r, verdict = attack(host / "ws", errno_of(f"open({target!r}, 'w').write('x')"))
    assert verdict == "EROFS", r
    if target != "/etc/passwd":
        assert not os.path.exists(target)


def test_write_host_tmp(host):
    """Write a file into /tmp expecting the host's /tmp. Contained: /tmp is a private tmpfs; nothing appears on the host."""
    target = f"/tmp/cadenza-escape-{uuid.uuid4().hex}"
    r, verdict = attack(host / "ws", errno_of(f"open({target!r}, 'w').write('x')"))
    assert verdict == "OK" and not os.path.exists(target), r


def test_write_home_and_sibling(host):
    """Write into the host home (~/.bashrc) and next to the workspace. Contained: neither path exists inside (ENOENT or EROFS); host files untouched."""
    home_file = Path.home() / f".cadenza-escape-{uuid.uuid4().hex}"
    sibling = host / "project" / "solution.py"
    for target in (home_file, sibling):
        r, verdict = attack(host / "ws", errno_of(f"open({str(target)!r}, 'w').write('pwned')"))
        assert verdict in ("ENOENT", "EROFS"), r
    assert not home_file.exists()
    assert SECRET in sibling.read_text()


def test_write_into_ro_bind(host):
    """Modify the interpreter's read-only venv (a task's environment). Contained: read-only bind: EROFS."""
    import sys

    target = Path(sys.prefix) / "pyvenv.cfg"
    before = target.read_bytes()
    r, verdict = attack(host / "ws", errno_of(f"open({str(target)!r}, 'a').write('x')"))
    assert verdict == "EROFS", r
    assert target.read_bytes() == before


# --- reads of host secrets ----------------------------------------------------------------


def test_read_planted_secret_file(host):
    """Read a secret planted in a host directory that is not bound. Contained: the directory does not exist inside."""
    r, verdict = attack(host / "ws", errno_of(f"open({str(host / 'secret' / 'token')!r}).read()"))
    assert verdict == "ENOENT", r
    assert SECRET not in r.stdout + r.stderr


def test_read_host_copy_of_project(host):
    """Read the host's copy of the task's project beside the workspace (the removed code). Contained: only the workspace itself is bound; its parent shows nothing else."""
    code = f"""
        import os, json
        print(json.dumps([os.path.exists({str(host / "project")!r}), os.listdir({str(host)!r})]))
    """
    r, verdict = attack(host / "ws", code)
    assert verdict == [False, ["ws"]], r


def test_read_secret_env_var(host):
    """Read a secret from the environment (os.environ, /proc/self/environ). Contained: the environment is rebuilt from scratch."""
    code = (
        "import os, json; print(json.dumps([dict(os.environ), open('/proc/self/environ').read()]))"
    )
    r, (env, raw) = attack(host / "ws", code)
    assert "CADENZA_TEST_SECRET" not in env and SECRET not in raw and SECRET not in r.stdout


def test_env_cannot_reach_the_launcher(host):
    """Pass LD_PRELOAD (a library in the workspace), hoping the privileged launcher (bwrap, started by host root) loads it. Contained: the command's environment reaches bwrap only as --setenv options; bwrap's own environment is PATH alone (checked in /proc on the host while it runs)."""
    import threading

    marker = f"cadenza-env-{uuid.uuid4().hex}"
    evil = str(host / "ws" / "evil.so")
    done = {}
    t = threading.Thread(
        target=lambda: done.update(
            r=box(host / "ws").run(
                ["sh", "-c", "sleep 1; echo $LD_PRELOAD", marker], env={"LD_PRELOAD": evil}
            )
        )
    )
    t.start()
    environs = {}
    deadline = time.monotonic() + 10
    while t.is_alive() and time.monotonic() < deadline:
        for pid in host_pids_with(marker):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/exe").endswith("bwrap"):
                    environs[pid] = Path(f"/proc/{pid}/environ").read_bytes()
        time.sleep(0.05)
    t.join()
    assert environs, "never saw the launcher running"
    assert all(
        env.split(b"\0")[0].startswith(b"PATH=") and b"LD_PRELOAD" not in env
        for env in environs.values()
    ), environs
    assert done["r"].stdout.strip() == evil  # the command itself does get its variable


def test_read_host_environ_through_proc(host):
    """Read the host runner's /proc/PID/environ (it holds the secret). Contained: host pids do not exist in the sandbox's pid namespace."""
    r, verdict = attack(host / "ws", errno_of(f"open('/proc/{os.getpid()}/environ').read()"))
    assert verdict == "ENOENT", r


def _bound() -> list[Path]:
    """What the battery binds read-only: the test interpreter's venv and base install."""
    import sys

    return [Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()]


def test_read_host_home_and_work_dirs(host):
    """List the host's home, /home, /work, /root, /srv, /opt, /var for credentials and other checkouts. Contained: these exist inside only as the bare path down to a bound directory (here the interpreter's install); nothing else in them is visible."""
    bound = _bound()
    ancestors = sorted({str(a) for b in bound for a in b.parents if str(a) != "/"})
    probes = ["/home", "/work", "/srv", "/opt", "/var", "/mnt", "/run", "/sys", "/boot", "/root"]
    probes += [str(p) for p in Path.home().iterdir()]
    code = f"""
        import os, json
        ancestors, bound = set({ancestors!r}), {[str(b) for b in bound]!r}
        seen = []
        def walk(p):
            if any(p == b or p.startswith(b + "/") for b in bound):
                return
            if p not in ancestors:
                seen.append(p)
                return
            for e in os.listdir(p):
                walk(os.path.join(p, e))
        for p in {probes!r}:
            if os.path.lexists(p):
                walk(p)
        print(json.dumps(seen))
    """
    r, verdict = attack(host / "ws", code)
    assert verdict == [], r


def test_read_system_secrets(host):
    """Read /etc/shadow, SSH/TLS private keys, git credential config. Contained: /etc is a minimal whitelist; these are absent."""
    paths = [
        "/etc/shadow",
        "/etc/gshadow",
        "/etc/ssl/private",
        "/etc/ssh",
        "/etc/gitconfig",
        "/etc/resolv.conf",
        "/etc/pip.conf",
    ]
    code = f"import os, json; print(json.dumps([p for p in {paths!r} if os.path.lexists(p)]))"
    r, verdict = attack(host / "ws", code)
    assert verdict == [], r


def test_inherited_file_descriptors(host):
    """Use a file descriptor the runner holds open on a host secret (marked inheritable) to read it. Contained: only stdin/stdout/stderr reach the command (close_fds; bwrap closes its own control fds)."""
    fd = os.open(host / "secret" / "token", os.O_RDONLY)
    os.set_inheritable(fd, True)
    try:
        code = "import os, json; print(json.dumps(sorted(int(f) for f in os.listdir('/proc/self/fd'))))"
        r, verdict = attack(host / "ws", code)
    finally:
        os.close(fd)
    assert verdict[:3] == [0, 1, 2] and len(verdict) == 4, r  # 4th: the listing's own fd


def test_symlink_escape(host):
    """A symlink in the workspace pointing at a host secret (planted before the run). Contained: the link resolves inside the sandbox, where the target does not exist."""
    ws = host / "ws"
    (ws / "link").symlink_to(host / "secret" / "token")
    (ws / "rootlink").symlink_to("/")
    code = """
        import os, json
        out = []
        try:
            out.append(open("link").read())
        except OSError as e:
            out.append(e.strerror)
        out.append(sorted(os.listdir("rootlink")))
        print(json.dumps(out))
    """
    r, verdict = attack(ws, code)
    assert SECRET not in r.stdout and verdict[0] == "No such file or directory", r
    sandbox_root = {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "sbin",
        "tmp",
        "usr",
    }
    sandbox_root |= {p.parts[1] for p in [*_bound(), host]}
    assert set(verdict[1]) <= sandbox_root, verdict[1]


def test_symlink_left_for_the_host(host):
    """Leave symlinks in the workspace (a file, and a parent directory) pointing at host files, for a host-side tool or grader to read or overwrite later. Contained: host code resolves workspace paths with sandbox.inside(), which refuses them (PathEscape)."""
    from cadenza.sandbox import PathEscape, inside

    ws = host / "ws"
    secret = host / "secret" / "token"
    r = box(ws).run(["sh", "-c", f"ln -s {secret} leak && ln -s {host / 'secret'} d && mkdir ok"])
    assert r.returncode == 0, r
    for rel in ("leak", "d/token", "d/new_file", "../secret/token", str(secret)):
        with pytest.raises(PathEscape):
            inside(ws, rel)
    assert inside(ws, "ok/new.py") == ws.resolve() / "ok" / "new.py"


def test_hardlink_escape(host):
    """Hardlink a host file (a toolchain binary, the venv config) into the workspace to write through it. Contained: the files sit on other mounts: EXDEV, so no link is made."""
    import sys

    code = f"""
        import os, json
        out = []
        for src in ("/usr/bin/env", {str(Path(sys.prefix) / "pyvenv.cfg")!r}, "/etc/passwd"):
            try:
                os.link(src, "hl-" + os.path.basename(src))
                out.append("linked")
            except OSError as e:
                out.append(__import__("errno").errorcode[e.errno])
        print(json.dumps(out))
    """
    r, verdict = attack(host / "ws", code)
    assert verdict == ["EXDEV"] * 3, r
    assert not list((host / "ws").glob("hl-*"))


# --- processes ----------------------------------------------------------------------------


def test_kill_the_runner(host):
    """kill -9 the host pid of the runner (passed in). Contained: host pids are invisible (ESRCH); the runner survives."""
    r, verdict = attack(host / "ws", errno_of(f"__import__('os').kill({os.getpid()}, 9)"))
    assert verdict == "ESRCH", r


def test_kill_everything(host):
    """kill(-1, SIGKILL): kill every process it may signal, e.g. a host process of the same uid. Contained: the pid namespace limits -1 to the sandbox's own processes; a host sleeper survives."""
    victim = subprocess.Popen(["sleep", "30"])
    try:
        box(host / "ws").run(["sh", "-c", "kill -9 -1; sleep 1"])
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_ptrace_the_runner(host):
    """PTRACE_ATTACH to the host runner to read its memory. Contained: the pid is not in the sandbox's namespace (ESRCH) and no capabilities are held."""
    pid = os.getpid()
    code = f"""
        import ctypes, json
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.ptrace(16, {pid}, None, None)
        print(json.dumps([rc, __import__("errno").errorcode.get(ctypes.get_errno())]))
    """
    r, verdict = attack(host / "ws", code)
    assert verdict[0] == -1 and verdict[1] in ("ESRCH", "EPERM"), r


def test_proc_shows_only_sandbox_processes(host):
    """Enumerate /proc to find host processes. Contained: a fresh procfs of the sandbox's pid namespace: only its own few pids, none of the host's."""
    code = "import os, json; print(json.dumps(sorted(int(p) for p in os.listdir('/proc') if p.isdigit())))"
    r, verdict = attack(host / "ws", code)
    assert len(verdict) <= 3 and os.getpid() not in verdict, r


def test_capabilities_and_setuid(host):
    """Gain root: setuid-root binaries (su, mount), capabilities. Contained: no_new_privs (setuid bits ignored), an empty capability set, uid 1000 inside."""
    r = box(host / "ws").run(
        [
            "sh",
            "-c",
            "grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status; id -u; su -c id root </dev/null; mount -t tmpfs none /tmp 2>&1; echo end",
        ]
    )
    assert "CapEff:\t0000000000000000" in r.stdout and "NoNewPrivs:\t1" in r.stdout, r
    assert "\n1000\n" in r.stdout and "uid=0" not in r.stdout


def test_mount(host):
    """mount(2) a tmpfs or re-bind / writable. Contained: no CAP_SYS_ADMIN: EPERM."""
    code = """
        import ctypes, json, os
        libc = ctypes.CDLL(None, use_errno=True)
        os.makedirs("m", exist_ok=True)
        a = libc.mount(b"none", b"m", b"tmpfs", 0, None)
        e1 = ctypes.get_errno()
        b = libc.mount(b"/", b"/", None, 0x20 | 0x1000, None)  # MS_REMOUNT|MS_BIND
        e2 = ctypes.get_errno()
        print(json.dumps([a, b, e1, e2]))
    """
    r, verdict = attack(host / "ws", code)
    assert verdict[:2] == [-1, -1] and verdict[2] == verdict[3] == 1, r  # EPERM


def test_chroot_and_unshare(host):
    """chroot, or unshare new namespaces (user, mount, net) to regain privileges. Contained: no capabilities (EPERM) and nested user namespaces are disabled (ENOSPC)."""
    code = """
        import ctypes, json, os
        libc = ctypes.CDLL(None, use_errno=True)
        out = []
        for fn, arg in ((libc.chroot, b"/tmp"), (libc.unshare, 0x10000000), (libc.unshare, 0x00020000), (libc.unshare, 0x40000000)):
            rc = fn(arg)
            out.append([rc, ctypes.get_errno()])
        print(json.dumps(out))
    """
    r, verdict = attack(host / "ws", code)
    assert all(rc == -1 for rc, _ in verdict), r
    assert verdict[0][1] == 1 and verdict[1][1] in (28, 1), r  # chroot EPERM; userns ENOSPC/EPERM


def test_raise_rlimits(host):
    """Raise the hard limits (address space, processes, CPU) back to unlimited. Contained: raising a hard limit needs CAP_SYS_RESOURCE: refused."""
    code = """
        import resource as r, json
        out = []
        for res in (r.RLIMIT_AS, r.RLIMIT_NPROC, r.RLIMIT_CPU, r.RLIMIT_FSIZE):
            try:
                r.setrlimit(res, (r.RLIM_INFINITY, r.RLIM_INFINITY))
                out.append("raised")
            except (ValueError, OSError):
                out.append("refused")
        print(json.dumps(out))
    """
    r, verdict = attack(host / "ws", code)
    assert verdict == ["refused"] * 4, r


def test_kernel_and_device_writes(host):
    """Write to /proc/sysrq-trigger, kernel settings, raw disks, the controlling terminal. Contained: no capabilities, no /sys, a minimal /dev without disks; no controlling tty (new session)."""
    code = """
        import json, os
        out = {}
        for p in ("/proc/sysrq-trigger", "/proc/sys/kernel/panic", "/proc/sys/vm/drop_caches", "/dev/vda", "/dev/sda", "/sys/kernel/uevent_helper", "/dev/tty"):
            try:
                with open(p, "w") as f:
                    f.write("x")
                out[p] = "wrote"
            except OSError as e:
                out[p] = e.__class__.__name__
        out["dev"] = sorted(os.listdir("/dev"))
        print(json.dumps(out))
    """
    r, verdict = attack(host / "ws", code)
    dev = verdict.pop("dev")
    assert "wrote" not in verdict.values(), r
    assert set(dev) <= {
        "core",
        "fd",
        "full",
        "null",
        "ptmx",
        "pts",
        "random",
        "shm",
        "stderr",
        "stdin",
        "stdout",
        "tty",
        "urandom",
        "zero",
    }


def test_change_hostname(host):
    """Rename the machine (sethostname via /proc/sys/kernel/hostname). Contained: the sandbox has its own UTS namespace; the write lands there and the host's name is unchanged."""
    before = socket.gethostname()
    attack(host / "ws", errno_of("open('/proc/sys/kernel/hostname', 'w').write('pwned')"))
    assert socket.gethostname() == before != "pwned"


def _syscalls(names_nrs: dict[str, int]) -> str:
    return f"""
        import ctypes, json
        libc = ctypes.CDLL(None, use_errno=True)
        out = {{}}
        for name, nr in {names_nrs!r}.items():
            rc = libc.syscall(nr, 0, 0, 0, 0, 0)
            out[name] = [rc, ctypes.get_errno()]
        print(json.dumps(out))
    """


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 syscall numbers")
def test_kernel_attack_surface_syscalls(host):
    """Reach io_uring, bpf, perf_event_open, userfaultfd, keyctl/add_key (unprivileged, exploit-prone kernel interfaces). Contained: the seccomp filter returns EPERM."""
    nrs = {
        "io_uring_setup": 425,
        "bpf": 321,
        "perf_event_open": 298,
        "userfaultfd": 323,
        "keyctl": 250,
        "add_key": 248,
    }
    r, verdict = attack(host / "ws", _syscalls(nrs))
    assert all(v == [-1, 1] for v in verdict.values()), verdict


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ABIs")
def test_seccomp_bypass_via_other_abis(host):
    """Bypass a syscall filter through the x32 ABI (nr | 0x40000000) or 32-bit `int 0x80` (i386 numbers). Contained: the filter refuses any non-native ABI (ENOSYS), or the kernel has no such ABI."""
    r, verdict = attack(
        host / "ws", _syscalls({"x32_keyctl": 0x40000000 | 250, "x32_getpid": 0x40000000 | 39})
    )
    assert verdict == {"x32_keyctl": [-1, 38], "x32_getpid": [-1, 38]}, r
    code = """
        import ctypes, json, mmap
        # mov eax, 20 (i386 getpid); int 0x80; ret
        buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        buf.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        print(json.dumps(ctypes.CFUNCTYPE(ctypes.c_int)(addr)()))
    """
    r, verdict = attack(host / "ws", code)
    assert verdict == -38 or r.killed_by == "SIGSEGV", r  # -ENOSYS, not a pid


# --- resource exhaustion ------------------------------------------------------------------


def test_fork_bomb(host):
    """Fork bomb (a shell function piping into itself in the background). Contained: a pids cgroup caps the sandbox's tasks (RLIMIT_NPROC for non-root runners), the timeout and the pid namespace end the rest; nothing is left on the host."""
    marker = f"cadenza-bomb-{uuid.uuid4().hex}"
    t0 = time.monotonic()
    r = box(host / "ws", timeout=5, limits=Limits(processes=64)).run(
        ["sh", "-c", "b() { b | b & }; b; sleep 3", marker]
    )
    assert time.monotonic() - t0 < 15
    assert host_pids_with(marker) == [], r
    assert subprocess.run(["true"]).returncode == 0


def test_python_fork_bomb_is_capped(host):
    """os.fork() in a loop, counting successes. Contained: forks fail at the process cap (EAGAIN), well below the host's pid space."""
    marker = f"cadenza-pybomb-{uuid.uuid4().hex}"
    code = f"""
        import os, json, time
        n = 0
        try:
            while n < 5000:
                if os.fork() == 0:
                    time.sleep(20); os._exit(0)
                n += 1
        except OSError as e:
            pass
        print(json.dumps(n), flush=True)
        os._exit(0)
        # {marker}
    """
    r, n = attack(host / "ws", code, timeout=10, limits=Limits(processes=50))
    assert n is not None and n < 50, r
    assert host_pids_with(marker) == []


def test_memory_bomb(host):
    """Allocate 8 GiB at once, then grow a list of 64 MiB blocks. Contained: RLIMIT_AS (memory_mb=512): MemoryError, the host keeps its memory."""
    code = """
        import json
        out = []
        try:
            b = bytearray(8 << 30)
            out.append("allocated")
        except MemoryError:
            out.append("MemoryError")
        blocks = []
        try:
            while True:
                blocks.append(bytearray(64 << 20))
        except MemoryError:
            out.append(len(blocks))
        print(json.dumps(out))
    """
    r, verdict = attack(host / "ws", code, memory_mb=512)
    assert verdict[0] == "MemoryError" and verdict[1] < 8, r


def _needs_cgroup(controller):
    from cadenza.sandbox import isolation

    if controller not in isolation().cgroups:
        pytest.skip(f"no writable {controller} cgroup here (the sandbox reports this)")


def test_memory_bomb_many_processes(host):
    """Six processes each fill 200 MiB (under the 512 MiB per-process limit; 1.2 GiB together). Contained: the memory cgroup caps the whole sandbox (400 MiB): the kernel OOM-kills inside it only."""
    _needs_cgroup("memory")
    code = """
        import json, os, time
        kids = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                b = b"\\x01" * (200 << 20)
                time.sleep(1)
                os._exit(0)
            kids.append(pid)
        print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids]))
    """
    r, codes = attack(host / "ws", code, limits=Limits(memory_mb=512, total_memory_mb=400))
    assert codes is not None and codes.count(-9) >= 4, r  # at most 2 x 200 MiB fit


def test_tmpfs_fill_counts_as_memory(host):
    """Fill the private /tmp (a RAM-backed tmpfs) with 256 MiB while its size cap allows 512. Contained: tmpfs pages count against the sandbox's 128 MiB memory cgroup: the writer fails or is OOM-killed."""
    _needs_cgroup("memory")
    code = """
        import json
        n = 0
        try:
            with open("/tmp/fill", "wb") as f:
                while n < 256:
                    f.write(b"\\x01" * (1 << 20)); f.flush(); n += 1
            print(json.dumps(["wrote", n]))
        except OSError as e:
            print(json.dumps([e.strerror, n]))
    """
    r, verdict = attack(host / "ws", code, limits=Limits(tmp_mb=512, total_memory_mb=128))
    assert r.killed_by == "memory" or (verdict and verdict[0] != "wrote" and verdict[1] < 128), r


def test_disk_fill_workspace(host):
    """Fill the disk by writing an endless file into the workspace. Contained: RLIMIT_FSIZE (file_size_mb=8): the write fails at 8 MiB (SIGXFSZ/EFBIG)."""
    code = """
        import json, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        n = 0
        try:
            with open("big", "wb") as f:
                while n < (1 << 30):
                    f.write(b"\\0" * (1 << 20)); f.flush(); n += 1 << 20
        except OSError as e:
            print(json.dumps(e.strerror))
    """
    r, verdict = attack(host / "ws", code, limits=Limits(file_size_mb=8))
    assert verdict == "File too large", r
    assert (host / "ws" / "big").stat().st_size <= 8 << 20


def test_disk_fill_many_files(host):
    """Fill the disk with many files, each under the file-size limit (8 MiB x up to 200). Contained: the runner totals what the run wrote to the workspace (disk_mb=64) and kills it (killed_by="disk")."""
    code = """
        import os
        for i in range(200):
            with open(f"f{i}", "wb") as f:
                f.write(os.urandom(8 << 20))
    """
    lim = Limits(file_size_mb=8, disk_mb=64)
    r = py(host / "ws", textwrap.dedent(code), limits=lim, timeout=60)
    written = sum(p.stat().st_size for p in (host / "ws").iterdir())
    assert r.killed_by == "disk" and written < 64 * 4 << 20, (r, written >> 20)


def test_disk_fill_tmp(host):
    """Fill /tmp with many small files (each under the file-size limit). Contained: /tmp is a size-capped tmpfs (tmp_mb=16): ENOSPC, in the sandbox's memory, gone after the run."""
    code = """
        import json, os
        n = 0
        try:
            while n < 1000:
                with open(f"/tmp/f{n}", "wb") as f:
                    f.write(os.urandom(1 << 20))
                n += 1
        except OSError as e:
            print(json.dumps([n, e.strerror]))
    """
    r, verdict = attack(host / "ws", code, limits=Limits(tmp_mb=16))
    assert verdict[1] == "No space left on device" and verdict[0] <= 16, r


def test_infinite_loop(host):
    """Busy loop forever. Contained: RLIMIT_CPU (cpu_seconds=1) sends SIGXCPU long before the 30 s wall-clock timeout."""
    t0 = time.monotonic()
    r = py(host / "ws", "while True: pass", timeout=30, limits=Limits(cpu_seconds=1))
    assert r.killed_by in ("SIGXCPU", "SIGKILL") and not r.timed_out, r
    assert time.monotonic() - t0 < 25  # well before the 30 s timeout, even on a loaded machine


def test_cpu_hog_many_processes(host):
    """Busy-loop in four processes to take every core of the shared machine. Contained: a CPU quota on the sandbox's cgroup (cpus=0.05 here): together they get 5% of one core, however many processes."""
    _needs_cgroup("cpu")
    code = """
        import json, os, time
        t0, c0 = time.monotonic(), os.times()
        kids = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                while time.process_time() < 0.02:
                    pass
                os._exit(0)
            kids.append(pid)
        for k in kids:
            os.waitpid(k, 0)
        c1 = os.times()
        cpu = c1.children_user + c1.children_system - c0.children_user - c0.children_system
        print(json.dumps([cpu, time.monotonic() - t0]))
    """
    r, verdict = attack(host / "ws", code, limits=Limits(cpus=0.05))
    cpu, wall = verdict
    # Uncapped, 0.08 CPU-s take ~0.04 s on two idle cores (a rate near 2 cores).
    assert cpu >= 0.05 and cpu / wall <= 0.05 * 1.6, (r, cpu, wall)


def test_sleep_past_timeout(host):
    """Sleep past the wall-clock timeout (no CPU used, so no CPU limit applies). Contained: killed at the timeout, status 124."""
    r = box(host / "ws", timeout=1).run(["sleep", "60"])
    assert r.timed_out and r.returncode == 124 and 1 <= r.duration_s < 10, r


def test_daemon_does_not_survive(host):
    """Daemonize (double fork + setsid, ignore SIGHUP/SIGTERM, close stdio) and keep writing a heartbeat file. Contained: when the command exits, the pid namespace dies and takes the daemon with it."""
    marker = f"cadenza-daemon-{uuid.uuid4().hex}"
    ws = host / "ws"
    code = f"""
        import os, signal, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                os.closerange(0, 3)
                while True:
                    with open("heartbeat", "a") as f:
                        f.write("beat\\n")
                    time.sleep(0.05)
            os._exit(0)
        time.sleep(0.3)
        print('"parent done"')
        # {marker}
    """
    t0 = time.monotonic()
    r = py(ws, textwrap.dedent(code), timeout=20)
    assert time.monotonic() - t0 < 15, r  # before the 20 s timeout
    assert host_pids_with(marker) == []
    size = (ws / "heartbeat").stat().st_size
    time.sleep(0.3)
    assert (ws / "heartbeat").stat().st_size == size


def test_daemon_holding_stdout_does_not_hang_runner(host):
    """A detached child that keeps stdout open after the command exits (would make a naive reader wait forever). Contained: the namespace's processes die with the command, so the pipe closes at once."""
    t0 = time.monotonic()
    r = box(host / "ws", timeout=20).run(["sh", "-c", "setsid sleep 60 & echo started"])
    assert r.stdout == "started\n" and not r.timed_out and time.monotonic() - t0 < 15, r


def test_timeout_kills_process_tree(host):
    """On timeout, children and grandchildren (in new sessions) keep running. Contained: killing bwrap kills the namespace's init and with it every process; none left on the host."""
    marker = f"cadenza-tree-{uuid.uuid4().hex}"
    r = box(host / "ws", timeout=1).run(
        [
            "sh",
            "-c",
            f"setsid sh -c 'sleep 60; : {marker}' & (sh -c 'sleep 61; : {marker}' &); sleep 62",
            marker,
        ]
    )
    assert r.timed_out
    assert host_pids_with(marker) == []


# --- output -------------------------------------------------------------------------------


def test_huge_output(host):
    """Print endlessly (`yes`) to exhaust the runner's memory. Contained: 1 MiB per stream kept, the rest read and dropped; the timeout ends it; truncated is flagged."""
    r = box(host / "ws", timeout=2).run(["yes"])
    assert r.timed_out and r.truncated and len(r.stdout) == 1 << 20, (r.returncode, len(r.stdout))


def test_huge_finite_output_then_exit(host):
    """Write 50 MiB to stdout then exit normally. Contained: capped at 1 MiB, status kept, no timeout."""
    r = box(host / "ws").run(["head", "-c", str(50 << 20), "/dev/zero"])
    assert r.returncode == 0 and r.truncated and len(r.stdout) == 1 << 20 and not r.timed_out


def test_binary_output(host):
    """Emit raw binary and invalid UTF-8 on both streams. Contained: decoded with U+FFFD replacement; never an exception."""
    code = "import os; os.write(1, bytes(range(256)) * 64); os.write(2, b'\\xff\\xfe\\x00\\xc3')"
    r = py(host / "ws", code)
    assert r.returncode == 0
    assert r.stdout == (bytes(range(256)) * 64).decode("utf-8", "replace")
    assert r.stderr == "\ufffd\ufffd\x00\ufffd"


def test_interpreter_is_the_same(host):
    """Sanity for the battery: the attacks run in the same interpreter as the host test. Contained: n/a (guards against false passes from a broken sandbox)."""
    r = box(host / "ws").run([PY, "-c", "import sys; print(sys.version)"])
    import sys

    assert r.stdout.strip() == sys.version and shutil.which("bwrap")
