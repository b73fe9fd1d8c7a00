"""The joint reward of the two coding tasks (docs/reference.md §3.3), maximum 4.0.

1. structure: ``aux`` defined with a return value +0.4 (optional); the main function defined
   with a return value +0.6, else the sum stops;
2. syntax: the assembled program compiles +0.5, else the sum stops;
3. tests: +1.0 x the fraction of the problem's asserts that pass in the sandbox;
4. cooperation, only when the helper's ``aux`` really helped pass a test: +0.5, +1.0 more
   when main is not a thin wrapper around ``aux``, -0.5 when main discards every result of
   ``aux`` (the reference meant to apply this penalty, but its check never fires).

The cooperation bonus is paid only when all of these hold: the helper's answer defines
``aux``; main calls ``aux`` and binds no name ``aux`` of its own (``binds_name``); and the
helper's ``aux`` returned a value during at least one passing assert. The last is recorded by
the sandbox, not claimed by the program: the helper's code runs in a worker process of its
own, and main's calls reach it only through the trusted judge, which notes each call that
returned (``TestOutcome.helper_ran``). So a main that brings its own ``aux``, wraps a missing
one in ``try``/``except``, or calls it only on a dead branch earns no bonus alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..sandbox import TestJob, TestReport, count_tests, run_tests
from .code_analysis import (
    aux_usage,
    binds_name,
    code_region,
    extract_definitions,
    parses,
    problem_context,
    returns_value,
)

AUX_STRUCTURE = 0.4
MAIN_STRUCTURE = 0.6
SYNTAX = 0.5
TESTS = 1.0
CALLS_AUX_BONUS = 0.5
NOT_A_WRAPPER_BONUS = 1.0
IGNORED_RESULT_PENALTY = -0.5
MAX_CODING_REWARD = (
    AUX_STRUCTURE + MAIN_STRUCTURE + SYNTAX + TESTS + CALLS_AUX_BONUS + NOT_A_WRAPPER_BONUS
)
PART_NAMES = ("aux_structure", "main_structure", "syntax", "tests", "cooperation")
HELPER_NAME = "aux"
FEEDBACK_FAILURES = 1  # failing asserts shown verbatim at the next turn, by default


@dataclass(frozen=True)
class CodingScore:
    parts: dict[str, float]
    details: dict[str, object]  # deterministic: counts, flags and short messages
    report: TestReport | None  # None when the tests did not run
    program: str  # context + aux + main: what the syntax level compiles, and what a user reads


def assemble(problem_prompt: str, entry_point: str, aux_text: str, main_text: str):
    """Build the program ``context + aux + main`` and the static facts the reward needs."""
    aux = extract_definitions(aux_text, HELPER_NAME, exclude=frozenset({entry_point}))
    main = extract_definitions(main_text, entry_point, exclude=frozenset({HELPER_NAME}))
    context = problem_context(problem_prompt, entry_point)
    return aux, main, _join(context, aux.source, main.source)


def _join(*parts: str) -> str:
    return "\n\n\n".join(part for part in parts if part.strip()) + "\n"


def score_coding(
    problem_prompt: str,
    test_code: str,
    entry_point: str,
    aux_text: str,
    main_text: str,
    sandbox_settings=None,
) -> CodingScore:
    aux, main, program = assemble(problem_prompt, entry_point, aux_text, main_text)
    parts = dict.fromkeys(PART_NAMES, 0.0)
    usage = aux_usage(main.target, HELPER_NAME)
    details: dict[str, object] = {
        "tests_passed": 0,
        "tests_total": count_tests(test_code),
        "aux_defined": aux.target_source != "",
        "main_defined": main.target_source != "",
        "main_calls_aux": usage.calls_aux,
        # the whole answer: a top-level ``def aux`` is dropped from the program, but it still
        # shows a main that meant to do the helper's part itself
        "main_binds_aux": binds_name(code_region(main_text), HELPER_NAME),
        "main_is_thin_wrapper": usage.thin_wrapper,
        "aux_result_ignored": usage.ignores_result,
        "aux_ran_in_passing_tests": 0,
        "syntax_error": "",
        "test_status": "not run",
    }
    if returns_value(aux):
        parts["aux_structure"] = AUX_STRUCTURE
    if not returns_value(main):
        return CodingScore(parts, details, None, program)
    parts["main_structure"] = MAIN_STRUCTURE

    compiles, reason = parses(program)
    if not compiles:
        details["syntax_error"] = reason
        return CodingScore(parts, details, None, program)
    parts["syntax"] = SYNTAX

    context = problem_context(problem_prompt, entry_point)
    helper_program = _join(context, aux.source) if details["aux_defined"] else ""
    job = TestJob(
        program=_join(context, main.source),
        test_code=test_code,
        entry_point=entry_point,
        helper_program=helper_program,
        helper_name=HELPER_NAME if helper_program else "",
    )
    report = run_tests(job, sandbox_settings)
    aux_helped = sum(outcome.passed and outcome.helper_ran for outcome in report.outcomes)
    details["tests_passed"] = report.passed
    details["test_status"] = report.status
    details["aux_ran_in_passing_tests"] = aux_helped
    if report.total:
        parts["tests"] = TESTS * report.passed / report.total
    if aux_helped and usage.calls_aux and not details["main_binds_aux"]:
        parts["cooperation"] = CALLS_AUX_BONUS
        if not usage.thin_wrapper:
            parts["cooperation"] += NOT_A_WRAPPER_BONUS
        if usage.ignores_result:
            parts["cooperation"] += IGNORED_RESULT_PENALTY
    return CodingScore(parts, details, report, program)


def coding_feedback(
    score: CodingScore, entry_point: str, max_failures: int = FEEDBACK_FAILURES
) -> str:
    """What went wrong, in the order the reward checks it.

    Shows the pass count, at most ``max_failures`` failing asserts verbatim, and only the
    error types of the others: printing every failing assert would hand a turn-2 answer most
    of its own test suite.
    """
    d = score.details
    lines = []
    if not d["aux_defined"]:
        lines.append(f"No function named `{HELPER_NAME}` was found in the helper's answer.")
    elif score.parts["aux_structure"] == 0:
        lines.append(f"`{HELPER_NAME}` does not return a value.")
    if not d["main_defined"]:
        lines.append(f"No function named `{entry_point}` was found in the main answer.")
    elif score.parts["main_structure"] == 0:
        lines.append(f"`{entry_point}` does not return a value.")
    if d["syntax_error"]:
        lines.append(f"The combined program does not compile: {d['syntax_error']}.")
    report = score.report
    if report is not None:
        lines.append(f"Tests passed: {report.passed}/{report.total}.")
        if report.status != "ok" and report.error:
            lines.append(f"The program stopped early: {report.error}.")
        failures = [outcome for outcome in report.outcomes if not outcome.passed]
        for outcome in failures[:max_failures]:
            lines.append(f"Failed: {outcome.source} -> {outcome.error}")
        hidden = Counter(_error_type(outcome.error) for outcome in failures[max_failures:])
        if hidden:
            kinds = ", ".join(f"{kind} x{count}" for kind, count in sorted(hidden.items()))
            lines.append(f"Other failing tests: {kinds}.")
    if d["main_defined"]:
        if d["main_binds_aux"]:
            lines.append(
                f"`{entry_point}` defines its own `{HELPER_NAME}`, so the helper's is never used."
            )
        elif not d["main_calls_aux"]:
            lines.append(f"`{entry_point}` does not call `{HELPER_NAME}`.")
        elif d["aux_result_ignored"]:
            lines.append(f"`{entry_point}` calls `{HELPER_NAME}` but ignores its result.")
        elif d["main_is_thin_wrapper"]:
            lines.append(f"`{entry_point}` only forwards to `{HELPER_NAME}`; do real work in both.")
        elif report is not None and report.passed and not d["aux_ran_in_passing_tests"]:
            lines.append(f"`{HELPER_NAME}` returned no value in any passing test.")
    return "\n".join(lines)


def _error_type(error: str) -> str:
    """``"TypeError: unsupported operand"`` -> ``"TypeError"``: the kind, not the values."""
    return error.split(":", 1)[0] or "error"
