"""The bubblewrap command line: which host paths a sandboxed command sees, and how.

Layout inside the sandbox (everything else of the host is absent):

    /usr /bin /sbin /lib* ........ read-only (the system toolchain)
    /etc ......................... a minimal subset: loader cache, certificates, timezone,
                                   alternatives; passwd/group/hosts are generated (no host
                                   accounts, no resolv.conf, no credential helpers)
    /proc ........................ a fresh procfs of the sandbox's own pid namespace
    /dev ......................... null zero full random urandom tty pts, private /dev/shm
    /tmp ......................... private tmpfs (size-capped); HOME=/tmp/home
    ro_binds, venv interpreters .. read-only at their host paths
    workspace .................... read-write at its host path (so venvs and paths work)
    /  ........................... remounted read-only last

Namespaces: user (the command runs as uid/gid 1000 with no capabilities, and may not make
further user namespaces), network (only a loopback of its own), pid, ipc, uts, cgroup.
A seccomp filter (seccomp.py) refuses io_uring, bpf, perf events, userfaultfd, keys.
`--new-session` detaches it from the terminal. bwrap returns as soon as the command
exits; `--die-with-parent` then kills the namespace's init, and with it the kernel kills
every process left in the namespace: a daemon cannot outlive its command (nor the runner).
"""

from __future__ import annotations

import atexit
import functools
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

UID = GID = 1000
USER = "sandbox"
HOME = "/tmp/home"
HOSTNAME = "sandbox"

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_SHARED = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/ssl/certs",
    "/etc/ssl/openssl.cnf",
    "/etc/ca-certificates",
    "/etc/ca-certificates.conf",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/nsswitch.conf",
    "/etc/protocols",
    "/etc/services",
    "/etc/mime.types",
    "/etc/magic",
    "/etc/os-release",
    "/etc/debian_version",
    "/etc/shells",
    "/etc/locale.alias",
)
ETC_GLOBS = ("/etc/python3*",)
ETC_GENERATED = {
    "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\n{USER}:x:{UID}:{GID}:{USER}:{HOME}:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": f"root:x:0:\n{USER}:x:{GID}:\nnogroup:x:65534:\n",
    "hosts": f"127.0.0.1\tlocalhost {HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    "hostname": f"{HOSTNAME}\n",
}

# Namespace flags. net and pid are what containment rests on (no network; kill-all on
# exit); the others are taken when the kernel allows them, and their absence is reported.
REQUIRED = {"net": ["--unshare-net"], "pid": ["--unshare-pid"]}
OPTIONAL = {
    "user": ["--unshare-user", "--uid", str(UID), "--gid", str(GID)],
    "nested-userns-off": ["--disable-userns"],  # needs "user"
    "ipc": ["--unshare-ipc"],
    "uts": ["--unshare-uts", "--hostname", HOSTNAME],
    "cgroup": ["--unshare-cgroup"],
}
WHAT_IT_MEANS = {
    "user": "the command runs with the runner's uid (capabilities are still dropped)",
    "nested-userns-off": "the command may create nested user namespaces",
    "ipc": "System V IPC objects and POSIX queues of the host are shared",
    "uts": "the host's hostname is visible",
    "cgroup": "the host's cgroup paths are visible",
}


@dataclass(frozen=True)
class Isolation:
    """What this machine's bubblewrap can isolate; `notes` say what is NOT isolated."""

    bwrap: str | None
    namespaces: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    tmpfs_size: bool = False
    seccomp: bool = False  # the syscall filter of seccomp.py can be loaded
    cgroups: tuple[str, ...] = ()  # controllers with per-command cgroups (pids, memory)
    notes: tuple[str, ...] = field(default=())

    @property
    def available(self) -> bool:
        return self.bwrap is not None and all(n in self.namespaces for n in REQUIRED)

    def flags(self) -> list[str]:
        out: list[str] = []
        for name in self.namespaces:
            out += REQUIRED.get(name) or OPTIONAL[name]
        return out


def seccomp_fd() -> int | None:
    """A pipe's read end holding the syscall filter, for `--seccomp FD` (None: no filter)."""
    from cadenza.sandbox.seccomp import filter_program

    prog = filter_program()
    if prog is None:
        return None
    r, w = os.pipe()
    os.write(w, prog)  # a few hundred bytes: fits the pipe buffer
    os.close(w)
    return r


def _try(bwrap: str, flags: list[str], fds: tuple[int, ...] = ()) -> tuple[bool, str]:
    argv = [bwrap, *flags, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, pass_fds=fds)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    return r.returncode == 0, r.stderr.strip()


@functools.cache
def probe(bwrap: str | None = None) -> Isolation:
    """Find the strongest namespace set bubblewrap can create here (once per process)."""
    from cadenza.sandbox import cgroup

    bwrap = bwrap or shutil.which("bwrap")
    cgroups = tuple(c for c in cgroup.CONTROLLERS if cgroup.find_hierarchy(c) is not None)
    cg_notes = ()
    if "pids" not in cgroups:
        cg_notes += (
            "no writable pids cgroup: the process count rests on RLIMIT_NPROC, which the "
            "kernel does not enforce when the runner is root",
        )
    if "memory" not in cgroups:
        cg_notes += (
            "no writable memory cgroup: memory is limited per process (RLIMIT_AS), not "
            "for the sandbox as a whole, and tmpfs only by its size",
        )
    if bwrap is None:
        return Isolation(None, notes=("bubblewrap (bwrap) is not installed",) + cg_notes)
    base = [f for name in REQUIRED for f in REQUIRED[name]]
    ok, err = _try(bwrap, base)
    if not ok:
        return Isolation(
            bwrap,
            missing=tuple(REQUIRED),
            notes=(f"bwrap cannot create network and pid namespaces here: {err}",) + cg_notes,
        )
    names = list(REQUIRED)
    flags = list(base)
    missing = []
    for name, extra in OPTIONAL.items():
        if name == "nested-userns-off" and "user" not in names:
            missing.append(name)
            continue
        if _try(bwrap, flags + extra)[0]:
            names.append(name)
            flags += extra
        else:
            missing.append(name)
    size_ok = _try(bwrap, flags + ["--size", "1048576", "--tmpfs", "/tmp"])[0]
    fd = seccomp_fd()
    seccomp_ok = False
    if fd is not None:
        try:
            seccomp_ok = _try(bwrap, flags + ["--seccomp", str(fd)], (fd,))[0]
        finally:
            os.close(fd)
    notes = tuple(f"no {m} namespace: {WHAT_IT_MEANS[m]}" for m in missing)
    if not size_ok:
        notes += ("bwrap has no --size: /tmp and /dev/shm are not size-capped",)
    if not seccomp_ok:
        notes += (
            "no seccomp filter: io_uring, bpf, perf_event_open, userfaultfd and the key "
            "store are reachable (namespaces and dropped capabilities still apply)",
        )
    return Isolation(
        bwrap,
        tuple(names),
        tuple(missing),
        size_ok,
        seccomp_ok,
        cgroups,
        notes + cg_notes,
    )


@functools.cache
def sandbox_etc() -> Path:
    """The sandbox's /etc, built once per process: whitelisted host entries, generated files.

    Copied (symlinks kept as symlinks) rather than bound one by one: a single bind mount
    instead of ~25 keeps the per-command setup cost low. Removed at exit.
    """
    root = Path(tempfile.mkdtemp(prefix="cadenza-sandbox-etc-"))
    etc = root / "etc"
    etc.mkdir()
    entries = [p for p in ETC_SHARED if os.path.lexists(p)]
    for pattern in ETC_GLOBS:
        entries += sorted(glob.glob(pattern))
    for src in entries:
        dst = etc / os.path.relpath(src, "/etc")
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dst, symlinks=True)
            else:
                shutil.copy2(src, dst, follow_symlinks=False)
        except OSError:
            continue  # unreadable host entry: simply absent inside
    for name, text in ETC_GENERATED.items():
        (etc / name).write_text(text)
    for d in (root, *[p for p in etc.rglob("*") if p.is_dir() and not p.is_symlink()], etc):
        d.chmod(0o755)
    owner = os.getpid()
    # Only the creating process removes it (not a forked worker that exits normally).
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(root, ignore_errors=True))
    return etc


def venv_interpreters(paths: Sequence[Path]) -> list[Path]:
    """Base interpreter prefixes of the virtualenvs at `paths` or one level below them.

    A venv's `python` is a symlink to its base interpreter (pyvenv.cfg `home = .../bin`),
    which may live outside the system dirs (pyenv under /root, conda, /opt); the sandbox
    needs that prefix too, read-only, or the venv cannot start.
    """
    out: list[Path] = []
    for p in paths:
        for cfg in [p / "pyvenv.cfg", *p.glob("*/pyvenv.cfg")]:
            try:
                lines = cfg.read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                key, _, value = line.partition("=")
                if key.strip() == "home" and value.strip():
                    prefix = Path(value.strip()).parent
                    if prefix.is_dir() and not any(
                        str(prefix).startswith(d + "/") or str(prefix) == d for d in SYSTEM_DIRS
                    ):
                        out.append(prefix)
    return out


def _system_mounts() -> list[str]:
    out: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            out += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            out += ["--ro-bind", d, d]
    return [*out, "--ro-bind", str(sandbox_etc()), "/etc"]


def bwrap_argv(
    isolation: Isolation,
    workspace: Path,
    ro_binds: Sequence[Path],
    cwd: Path,
    tmp_mb: int,
    shm_mb: int,
) -> list[str]:
    """The full bubblewrap prefix for one command (the command's argv follows it)."""
    if not isolation.available:
        raise RuntimeError("bwrap_argv needs an available isolation (check Isolation.available)")

    def tmpfs(path: str, mb: int) -> list[str]:
        size = ["--size", str(mb << 20)] if isolation.tmpfs_size else []
        return ["--perms", "1777", *size, "--tmpfs", path]

    argv = [
        str(isolation.bwrap),
        *isolation.flags(),
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        *_system_mounts(),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        *tmpfs("/dev/shm", shm_mb),
        "--remount-ro",
        "/dev",
        *tmpfs("/tmp", tmp_mb),
        "--dir",
        HOME,
    ]
    # Parents before children, so a read-only bind inside the workspace (a task's venv)
    # stays read-only and a workspace inside a read-only bind stays writable.
    binds = [(Path(p), "--ro-bind") for p in ro_binds] + [(workspace, "--bind")]
    for path, flag in sorted(binds, key=lambda b: len(b[0].parts)):
        argv += [flag, str(path), str(path)]
    argv += ["--remount-ro", "/", "--chdir", str(cwd), "--"]
    return argv
