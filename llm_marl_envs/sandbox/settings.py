"""Limits and isolation choice for the sandbox, validated eagerly."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ISOLATION_MODES = ("auto", "namespaces", "rlimits")


def _default_workers() -> int:
    """Twice the cores: part of every run is spent waiting on pipes and process start-up, so
    more runs than cores in flight raise throughput (docs/sandbox.md, Performance)."""
    return 2 * (os.cpu_count() or 1)


@dataclass(frozen=True)
class SandboxSettings:
    """Resource limits for one program run, plus run_many's concurrency.

    Attributes:
        test_timeout: wall-clock seconds for one execution of one assert (every call into
            the program made while evaluating it), for one call made outside an assert, and
            for loading the program.
        total_timeout: wall-clock seconds for the whole run of one program, start-up
            included; the parent kills everything shortly after it.
        memory_limit: address-space limit (RLIMIT_AS) in bytes of the program's process
            (the trusted judge gets 256 MiB more).
        max_processes: RLIMIT_NPROC of the program's dedicated uid (threads count too).
        max_file_size: RLIMIT_FSIZE in bytes; the private tmpfs (namespaces) is 4x this.
        max_open_files: RLIMIT_NOFILE of the program's process.
        output_limit: max bytes of one encoded value returned by the program (the program's
            own stdout/stderr are discarded, never parsed).
        max_workers: programs run concurrently by run_many (default: twice the cores).
        isolation: "namespaces" (fresh PID, network, mount and IPC namespaces plus a minimal
            read-only root; fail closed if unavailable), "rlimits" (resource limits and an
            unprivileged uid only), or "auto" (namespaces when the machine allows them).
        audit_hook: install the in-process audit hook that blocks fork/exec/sockets/ctypes
            and writes outside the working directory.  Defense in depth only: tests turn it
            off to check that the OS-level limits hold on their own.
    """

    test_timeout: float = 3.0
    total_timeout: float = 10.0
    memory_limit: int = 1 << 30
    max_processes: int = 16
    max_file_size: int = 16 << 20
    max_open_files: int = 64
    output_limit: int = 1 << 20
    max_workers: int = field(default_factory=_default_workers)
    isolation: str = "auto"
    audit_hook: bool = True

    def __post_init__(self) -> None:
        for name in ("test_timeout", "total_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxSettings.{name} must be a positive number: {value!r}")
        if self.test_timeout > self.total_timeout:
            raise ValueError("SandboxSettings.test_timeout must not exceed total_timeout")
        minimums = {
            "memory_limit": 64 << 20,
            "max_processes": 1,
            "max_file_size": 1 << 10,
            "max_open_files": 16,
            "output_limit": 1 << 10,
            "max_workers": 1,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"SandboxSettings.{name} must be an int >= {minimum}: {value!r}")
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(
                f"SandboxSettings.isolation must be one of {ISOLATION_MODES}: {self.isolation!r}"
            )
        if not isinstance(self.audit_hook, bool):
            raise ValueError("SandboxSettings.audit_hook must be a bool")
