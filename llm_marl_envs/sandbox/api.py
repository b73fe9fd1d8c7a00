"""Public value types of the sandbox: a job in, a deterministic report out."""

from __future__ import annotations

from dataclasses import dataclass

STATUSES = ("ok", "timeout", "error", "killed")


@dataclass(frozen=True)
class TestJob:
    """One program to judge against one HumanEval-style ``check``."""

    __test__ = False  # not a pytest test class

    program: str  # full program text: imports + helper function(s) + the entry point
    test_code: str  # HumanEval ``test`` field: defines ``check(candidate)``
    entry_point: str  # name of the function passed to ``check``
    #: Another agent's code, run in a worker of its own. ``program`` calls its function
    #: ``helper_name`` through the judge, which records whether it ran (``helper_ran``).
    helper_program: str = ""
    helper_name: str = ""


@dataclass(frozen=True)
class TestOutcome:
    """Result of one counted assert statement of ``check`` (static order)."""

    __test__ = False

    index: int  # 0-based position among the counted asserts of check()
    source: str  # the assert statement's source text, capped at ~300 chars
    passed: bool  # executed at least once and every execution passed
    error: str  # "" when passed, else e.g. "AssertionError", "TypeError: ...", "timeout"
    helper_ran: bool = False  # the helper's function returned a value (not None) during it


@dataclass(frozen=True)
class TestReport:
    """Deterministic summary of one run: no timings, PIDs or paths in any field.

    status: "ok" (the harness ran check() to the end), "timeout" (total budget exceeded or
    the program took longer than a test timeout to load), "error" (the program failed to
    load: syntax error, exception or exit at import time, entry point missing), "killed"
    (the program's process was killed by a resource limit/signal while loading, or the
    harness itself died).
    """

    __test__ = False

    status: str
    passed: int
    total: int  # == count_tests(test_code), whatever the program did
    outcomes: tuple[TestOutcome, ...]  # len == total
    error: str = ""  # short description when status != "ok"
