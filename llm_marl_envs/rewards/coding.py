"""The joint reward of the two coding tasks (REFERENCE.md §3.3), maximum 4.0.

1. structure: ``aux`` defined with a return value +0.4 (optional); the main function defined
   with a return value +0.6, else the sum stops;
2. syntax: the assembled program compiles +0.5, else the sum stops;
3. tests: +1.0 x the fraction of the problem's asserts that pass in the sandbox;
4. cooperation, only when at least one test passes and main calls ``aux``: +0.5, +1.0 more
   when main is not a thin wrapper around ``aux``, -0.5 when main discards every result of
   ``aux`` (the reference meant to apply this penalty, but its check never fires).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sandbox import TestJob, TestReport, count_tests, run_tests
from .code_analysis import aux_usage, extract_definitions, parses, problem_context, returns_value

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
MAX_FEEDBACK_FAILURES = 3


@dataclass(frozen=True)
class CodingScore:
    parts: dict[str, float]
    details: dict[str, object]  # deterministic: counts, flags and short messages
    report: TestReport | None  # None when the tests did not run
    program: str


def assemble(problem_prompt: str, entry_point: str, aux_text: str, main_text: str):
    """Build the program ``context + aux + main`` and the static facts the reward needs."""
    aux = extract_definitions(aux_text, HELPER_NAME, exclude=frozenset({entry_point}))
    main = extract_definitions(main_text, entry_point, exclude=frozenset({HELPER_NAME}))
    context = problem_context(problem_prompt, entry_point)
    program = "\n\n\n".join(part for part in (context, aux.source, main.source) if part.strip())
    return aux, main, program + "\n"


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
        "main_is_thin_wrapper": usage.thin_wrapper,
        "aux_result_ignored": usage.ignores_result,
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

    report = run_tests(
        TestJob(program=program, test_code=test_code, entry_point=entry_point), sandbox_settings
    )
    details["tests_passed"] = report.passed
    details["test_status"] = report.status
    if report.total:
        parts["tests"] = TESTS * report.passed / report.total
    if report.passed > 0 and usage.calls_aux:
        parts["cooperation"] = CALLS_AUX_BONUS
        if not usage.thin_wrapper:
            parts["cooperation"] += NOT_A_WRAPPER_BONUS
        if usage.ignores_result:
            parts["cooperation"] += IGNORED_RESULT_PENALTY
    return CodingScore(parts, details, report, program)


def coding_feedback(score: CodingScore, entry_point: str) -> str:
    """What went wrong, in the order the reward checks it, with a few failing tests verbatim."""
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
        for outcome in failures[:MAX_FEEDBACK_FAILURES]:
            lines.append(f"Failed: {outcome.source} -> {outcome.error}")
        if len(failures) > MAX_FEEDBACK_FAILURES:
            lines.append(f"... and {len(failures) - MAX_FEEDBACK_FAILURES} more failing tests.")
    if d["main_defined"]:
        if not d["main_calls_aux"]:
            lines.append(f"`{entry_point}` does not call `{HELPER_NAME}`.")
        elif d["aux_result_ignored"]:
            lines.append(f"`{entry_point}` calls `{HELPER_NAME}` but ignores its result.")
        elif d["main_is_thin_wrapper"]:
            lines.append(f"`{entry_point}` only forwards to `{HELPER_NAME}`; do real work in both.")
    return "\n".join(lines)
