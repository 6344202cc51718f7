"""A seccomp filter that refuses kernel interfaces a test suite has no use for.

Defence in depth: the namespaces and the empty capability set already stop mount, chroot
or module loading; the filter also shuts interfaces that are reachable WITHOUT privilege
and have been a steady source of kernel exploits (io_uring, bpf, perf events,
userfaultfd, the key store), and the legacy syscall ABIs (x32 numbers, 32-bit int 0x80 on
x86-64) that a filter keyed on 64-bit numbers would otherwise let through.

The program is classic BPF over `struct seccomp_data {int nr; u32 arch; ...}`:

    A = arch;  if A != NATIVE: return ERRNO(ENOSYS)
    A = nr;    [x86-64: if A >= 0x40000000 (x32): return ERRNO(ENOSYS)]
    if A in BLOCKED: return ERRNO(EPERM)
    return ALLOW

bwrap loads it (`--seccomp FD`) just before exec'ing the command, after no_new_privs.
"""

from __future__ import annotations

import errno
import platform
import struct

BLOCKED = (
    # privileged or host-wide (already refused for lack of capabilities; kept shut here)
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "unshare", "setns",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "syslog", "quotactl", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "name_to_handle_at", "open_by_handle_at", "lookup_dcookie", "iopl", "ioperm",
    # unprivileged kernel attack surface
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)  # fmt: skip

# Syscall numbers: arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/
# unistd.h (arm64); tests check them against the installed kernel headers.
X86_64 = {
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "unshare": 272, "setns": 308, "kexec_load": 246,
    "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "syslog": 103,
    "quotactl": 179, "vhangup": 153, "settimeofday": 164, "clock_settime": 227,
    "clock_adjtime": 305, "adjtimex": 159, "name_to_handle_at": 303,
    "open_by_handle_at": 304, "lookup_dcookie": 212, "iopl": 172, "ioperm": 173,
    "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427,
}  # fmt: skip
AARCH64 = {
    "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "unshare": 97, "setns": 268, "kexec_load": 104,
    "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106,
    "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89, "syslog": 116,
    "quotactl": 60, "vhangup": 58, "settimeofday": 170, "clock_settime": 112,
    "clock_adjtime": 266, "adjtimex": 171, "name_to_handle_at": 264,
    "open_by_handle_at": 265, "lookup_dcookie": 18, "keyctl": 219, "add_key": 217,
    "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
}  # fmt: skip

# AUDIT_ARCH_* values (linux/audit.h): machine | 64-bit | little-endian flags.
ARCHES = {"x86_64": (0xC000003E, X86_64), "aarch64": (0xC00000B7, AARCH64)}
X32_SYSCALL_BIT = 0x40000000

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
LD_W_ABS = 0x20
JEQ_K = 0x15
JGE_K = 0x35
RET_K = 0x06
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program(machine: str | None = None) -> bytes | None:
    """The BPF program (raw `struct sock_filter[]`) for `machine`, None if unsupported."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        return None
    audit_arch, numbers = ARCHES[machine]
    nrs = sorted({numbers[name] for name in BLOCKED if name in numbers})
    deny_other_abi = _insn(RET_K, RET_ERRNO | errno.ENOSYS)
    prog = [
        _insn(LD_W_ABS, 4),  # A = seccomp_data.arch
        _insn(JEQ_K, audit_arch, jt=1),
        deny_other_abi,
        _insn(LD_W_ABS, 0),  # A = seccomp_data.nr
    ]
    if machine == "x86_64":
        prog += [_insn(JGE_K, X32_SYSCALL_BIT, jf=1), deny_other_abi]
    # One compare per blocked number, each jumping forward to the shared EPERM return.
    for i, nr in enumerate(nrs):
        prog.append(_insn(JEQ_K, nr, jt=len(nrs) - i))
    prog += [_insn(RET_K, RET_ALLOW), _insn(RET_K, RET_ERRNO | errno.EPERM)]
    return b"".join(prog)
