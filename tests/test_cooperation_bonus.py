"""The cooperation bonus is earned by cooperating, not by ``main`` alone.

Each hack below lets ``main`` pass every test without the helper's ``aux`` doing the work:
it must score no cooperation, while the honest pair keeps its bonus. All run in the real
sandbox, where the helper's code has a worker process of its own and only the judge decides
whether it ran.
"""

from __future__ import annotations

import textwrap

import pytest

from llm_marl_envs.rewards.code_analysis import binds_name
from llm_marl_envs.rewards.coding import score_coding

PROMPT = '''def sum_of_squares(numbers: list) -> int:
    """Return the sum of the squares of the numbers.
    >>> sum_of_squares([1, 2, 3])
    14
    """
'''
TEST = textwrap.dedent(
    """
    def check(candidate):
        assert candidate([1, 2, 3]) == 14
        assert candidate([]) == 0
        assert candidate([-2]) == 4
        assert candidate([0, 5]) == 25
        assert candidate([1, 1, 1, 1]) == 4
    """
)
HELPER = "```python\ndef aux(numbers):\n    return [n * n for n in numbers]\n```"
NO_HELPER = "I cannot help."
HONEST_MAIN = "def sum_of_squares(numbers):\n    squares = aux(numbers)\n    return sum(squares)\n"
OWN_SOLUTION = "sum(n * n for n in numbers)"


def score(aux: str, main: str):
    return score_coding(PROMPT, TEST, "sum_of_squares", aux, textwrap.dedent(main))


def test_honest_pair_keeps_its_bonus() -> None:
    result = score(HELPER, HONEST_MAIN)
    assert result.details["tests_passed"] == 5
    assert result.details["aux_ran_in_passing_tests"] == 5
    assert result.parts["cooperation"] == pytest.approx(1.5)
    assert sum(result.parts.values()) == pytest.approx(4.0)


def test_thin_wrapper_keeps_only_the_call_bonus() -> None:
    helper = "def aux(numbers):\n    return sum(n * n for n in numbers)\n"
    result = score(helper, "def sum_of_squares(numbers):\n    return aux(numbers)\n")
    assert result.parts["cooperation"] == pytest.approx(0.5)


HACKS = {
    # main brings its own aux; the helper offers nothing
    "nested_def_without_helper": (NO_HELPER, f"""
        def sum_of_squares(numbers):
            def aux(values):
                return {OWN_SOLUTION.replace("numbers", "values")}
            return aux(numbers) + 0
        """),
    # a try/except shell around a helper that does not exist
    "try_except_shell": (NO_HELPER, f"""
        def sum_of_squares(numbers):
            try:
                return aux(numbers) + 0
            except Exception:
                return {OWN_SOLUTION}
        """),
    # the helper exists, but main shadows it with its own
    "nested_def_shadows_helper": (HELPER, f"""
        def sum_of_squares(numbers):
            def aux(values):
                return [{OWN_SOLUTION.replace("numbers", "values")}]
            return sum(aux(numbers))
        """),
    # the call sits on a branch no test takes
    "dead_branch": (HELPER, f"""
        def sum_of_squares(numbers):
            if numbers is None:
                return sum(aux(numbers))
            return {OWN_SOLUTION}
        """),
    # aux taken as a parameter with a default
    "parameter_default": (HELPER, """
        def sum_of_squares(numbers, aux=lambda values: [v * v for v in values]):
            return sum(aux(numbers))
        """),
    # aux assigned a lambda inside main
    "lambda_assignment": (HELPER, """
        def sum_of_squares(numbers):
            aux = lambda values: [v * v for v in values]
            return sum(aux(numbers))
        """),
    # aux rebound at module level through global
    "global_rebinding": (HELPER, """
        def sum_of_squares(numbers):
            global aux
            aux = lambda values: [v * v for v in values]
            return sum(aux(numbers))
        """),
    # aux imported under that name
    "import_as_aux": (HELPER, """
        def sum_of_squares(numbers):
            from builtins import list as aux
            return sum(aux(n * n for n in numbers))
        """),
    # aux as a comprehension target
    "comprehension_target": (HELPER, """
        def sum_of_squares(numbers):
            return sum(aux * aux for aux in numbers)
        """),
    # a helper that always raises, caught by main, which does the work itself
    "broken_helper_caught": ("def aux(numbers):\n    raise ValueError('no')\n", f"""
        def sum_of_squares(numbers):
            try:
                aux(numbers)
            except ValueError:
                pass
            return {OWN_SOLUTION}
        """),
    # main writes its own top-level aux (dropped from the program) and leans on it
    "top_level_def_aux_in_main": (HELPER, """
        def aux(numbers):
            return [n * n for n in numbers]

        def sum_of_squares(numbers):
            return sum(aux(numbers))
        """),
    # the helper's aux runs but returns nothing, and main does the work
    "helper_returns_none": ("def aux(numbers):\n    return None\n", f"""
        def sum_of_squares(numbers):
            result = aux(numbers)
            if result is None:
                return {OWN_SOLUTION}
            return result
        """),
    # main tries to make the judge believe aux ran by writing protocol frames itself
    "forged_protocol_frames": (NO_HELPER, f"""
        import os
        import sys
        def sum_of_squares(numbers):
            codec = sys.modules.get("codec")
            if codec is not None:
                for frame in (("call", "aux", (numbers,), {{}}), ("ok", 0)):
                    for fd in range(3, 16):
                        try:
                            codec.write_frame(fd, codec.encode(frame, 1 << 10))
                        except Exception:
                            pass
            return {OWN_SOLUTION}
        """),
}


@pytest.mark.parametrize("name", sorted(HACKS))
def test_main_alone_earns_no_cooperation(name: str) -> None:
    aux, main = HACKS[name]
    result = score(aux, main)
    assert result.parts["cooperation"] == 0.0, (name, result.details)
    assert result.details["aux_ran_in_passing_tests"] == 0 or result.details["main_binds_aux"]


@pytest.mark.parametrize(
    "name",
    ["nested_def_shadows_helper", "parameter_default", "lambda_assignment", "global_rebinding",
     "import_as_aux", "comprehension_target", "nested_def_without_helper"],
)
def test_every_way_of_binding_aux_is_seen(name: str) -> None:
    assert binds_name(textwrap.dedent(HACKS[name][1]), "aux")


def test_calling_aux_is_not_binding_it() -> None:
    assert not binds_name(HONEST_MAIN, "aux")
    assert not binds_name("def f(x):\n    return aux(x).real + aux.__name__.count('a')\n", "aux")
    for binding in ("except E as aux", "with f() as aux", "for aux in x", "(aux := 1)",
                    "match x:\n        case [aux]"):
        body = f"    {binding}:\n        pass" if not binding.startswith("(") else f"    {binding}"
        assert binds_name(f"def f(x):\n{body}\n", "aux"), binding


def test_arguments_are_copied_to_the_helper() -> None:
    """The helper's worker gets copies: an in-place change made by aux is not seen by main."""
    helper = "def aux(numbers):\n    numbers.append(100)\n    return len(numbers)\n"
    main = (
        "def sum_of_squares(numbers):\n    aux(numbers)\n    return sum(n * n for n in numbers)\n"
    )
    result = score(helper, main)
    assert result.details["tests_passed"] == 5
