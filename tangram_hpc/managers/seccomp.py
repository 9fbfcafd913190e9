"""The seccomp filter of sandboxed commands, as the classic BPF program bubblewrap loads.

bubblewrap installs it (``--seccomp FD``) just before it execs the command's
wrapper, so it binds the whole tree.  It denies, with an errno a program can
handle:

* new user namespaces (``unshare``/``clone`` with ``CLONE_NEWUSER``; ``clone3``,
  whose flags a filter cannot read, answers ENOSYS so libc falls back to
  ``clone``): inside one, a process has every capability over the mounts and
  namespaces it then creates, a large kernel attack surface;
* kernel keyrings (``keyctl``, ``add_key``, ``request_key``: not namespaced),
  ``bpf``, ``perf_event_open``, ``userfaultfd`` and ``io_uring`` (frequent
  kernel-exploit tools that sandboxed code does not need);
* ``fallocate`` (EOPNOTSUPP, so libc's ``posix_fallocate`` writes the blocks
  instead): it would reserve gigabytes in microseconds, faster than the disk
  quota is checked (:mod:`tangram_hpc.managers.diskquota`).

Everything else is allowed.  x86_64 (with its i386 entry points; x32 calls
are refused) and aarch64 (32-bit ARM calls are refused) are supported;
elsewhere :func:`program` returns None and the sandbox runs without a filter.
"""
from __future__ import annotations

import errno
import platform
import struct

__all__ = ["program", "CLONE_NEWUSER"]

CLONE_NEWUSER = 0x10000000

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6];
_NR, _ARCH, _ARG0_LOW = 0, 4, 16   # args[0] low word (little-endian)
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_X32_BIT = 0x40000000

_AUDIT_ARCH = {"x86_64": 0xC000003E, "i386": 0x40000003, "aarch64": 0xC00000B7, "arm": 0x40000028}

# (syscall, errno, flags that must be set in args[0] for the rule to apply)
_RULES: tuple[tuple[str, int, int | None], ...] = (
    ("unshare", errno.EPERM, CLONE_NEWUSER),
    ("clone", errno.EPERM, CLONE_NEWUSER),
    ("clone3", errno.ENOSYS, None),
    ("keyctl", errno.EPERM, None),
    ("add_key", errno.EPERM, None),
    ("request_key", errno.EPERM, None),
    ("bpf", errno.EPERM, None),
    ("perf_event_open", errno.EPERM, None),
    ("userfaultfd", errno.EPERM, None),
    ("io_uring_setup", errno.ENOSYS, None),
    ("io_uring_enter", errno.ENOSYS, None),
    ("io_uring_register", errno.ENOSYS, None),
    ("fallocate", errno.EOPNOTSUPP, None),
)

# Syscall numbers per ABI, from the kernel's unistd_64.h, unistd_32.h and asm-generic/unistd.h.
_ABIS = ("x86_64", "i386", "aarch64")
_TABLE = {
    "unshare": (272, 310, 97),
    "clone": (56, 120, 220),
    "clone3": (435, 435, 435),
    "keyctl": (250, 288, 219),
    "add_key": (248, 286, 217),
    "request_key": (249, 287, 218),
    "bpf": (321, 357, 280),
    "perf_event_open": (298, 336, 241),
    "userfaultfd": (323, 374, 282),
    "io_uring_setup": (425, 425, 425),
    "io_uring_enter": (426, 426, 426),
    "io_uring_register": (427, 427, 427),
    "fallocate": (285, 324, 47),
}
_NUMBERS = {abi: {name: nrs[i] for name, nrs in _TABLE.items()} for i, abi in enumerate(_ABIS)}
# Native ABI -> the compat ABI the kernel also accepts there, and whether we filter it (else refuse it).
_COMPAT = {"x86_64": ("i386", True), "aarch64": ("arm", False)}


class _Asm:
    """A few BPF instructions with forward jumps to labels."""

    def __init__(self) -> None:
        self.code: list[list] = []   # [op, jt, jf, k]; jt/jf may be label names
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int, jt: int | str = 0, jf: int | str = 0) -> None:
        self.code.append([code, jt, jf, k])

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = bytearray()
        for i, (code, jt, jf, k) in enumerate(self.code):
            jt, jf = (self.labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
            if not (0 <= jt < 256 and 0 <= jf < 256):
                raise ValueError("seccomp program jump out of range")
            out += struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)
        return bytes(out)


def _rules(asm: _Asm, abi: str) -> None:
    numbers = _NUMBERS[abi]
    for i, (name, err, mask) in enumerate(_RULES):
        nxt = f"{abi}-{i}"
        asm.op(_JEQ, numbers[name], 0, nxt)
        if mask is not None:
            asm.op(_LD_ABS, _ARG0_LOW)
            asm.op(_JSET, mask, 0, "allow")
        asm.op(_RET, _ERRNO | err)
        asm.label(nxt)
    asm.op(_RET, _ALLOW)


def program(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture, or None where it is not supported."""
    native = machine or platform.machine()
    if native not in _COMPAT:
        return None
    compat, filtered = _COMPAT[native]
    asm = _Asm()
    asm.op(_LD_ABS, _ARCH)
    asm.op(_JEQ, _AUDIT_ARCH[native], 0, "compat")
    asm.op(_LD_ABS, _NR)
    if native == "x86_64":
        asm.op(_JGE, _X32_BIT, "nosys", 0)
    _rules(asm, native)
    asm.label("compat")
    asm.op(_JEQ, _AUDIT_ARCH[compat], 0, "nosys")
    if filtered:
        asm.op(_LD_ABS, _NR)
        _rules(asm, compat)
    asm.label("nosys")   # an ABI we do not filter: refuse every call
    asm.op(_RET, _ERRNO | errno.ENOSYS)
    asm.label("allow")
    asm.op(_RET, _ALLOW)
    return asm.assemble()

