"""The coding tasks against real data: HumanEval (bundled) and CoopHumanEval (shared test data)."""

import ast
import copy
from concurrent.futures import ThreadPoolExecutor

import pytest

import llm_marl_envs
from llm_marl_envs.rewards.code_analysis import aux_usage, extract_definitions
from llm_marl_envs.rewards.coding import score_coding
from llm_marl_envs.sandbox import count_tests

TRIVIAL_AUX = "def aux(x):\n    return x"


def step_all(env, joint_actions):
    """Step one branch per dataset item concurrently, as a trainer scores a group."""

    def one(index_and_actions):
        index, actions = index_and_actions
        branch = copy.deepcopy(env)
        branch.reset(options={"index": index})
        return branch.step(actions)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(one, enumerate(joint_actions)))


def test_every_canonical_humaneval_solution_passes_every_test():
    env = llm_marl_envs.make("humaneval-v2", split="all")
    assert env.num_items == 164
    actions = [
        {"aux": TRIVIAL_AUX, "main": item["prompt"] + item["canonical_solution"]}
        for item in env.task.records
    ]
    results = step_all(env, actions)
    for item, (_, rewards, terminations, _, infos) in zip(env.task.records, results, strict=True):
        info = infos["main"]
        assert info["tests_total"] > 0, item["task_id"]
        assert info["tests_passed"] == info["tests_total"], (item["task_id"], info)
        assert all(terminations.values()), "a fully solved episode terminates"
        assert rewards["main"] == pytest.approx(0.4 + 0.6 + 0.5 + 1.0)  # no aux call: no bonus


def test_empty_bodies_score_no_test_on_humaneval():
    env = llm_marl_envs.make("humaneval-v2", split="all")
    pass_body = [
        {"aux": TRIVIAL_AUX, "main": item["prompt"] + "    pass\n"} for item in env.task.records
    ]
    for *_, infos in step_all(env, pass_body):
        assert infos["main"]["tests_passed"] == 0
        assert infos["main"]["reward_parts"]["main_structure"] == 0.0  # no return: sum stops
    raising = [
        {"aux": TRIVIAL_AUX, "main": item["prompt"] + "    raise NotImplementedError\n"}
        for item in env.task.records[:40]
    ]
    for _, _, _, _, infos in step_all(env, raising):
        assert infos["main"]["tests_passed"] == 0


def test_coophumaneval_loads_parses_and_scores_all_82(coophumaneval_file):
    env = llm_marl_envs.make("coophumaneval-v2", data=coophumaneval_file, split="all")
    assert env.num_items == 82
    totals = [count_tests(item["test"]) for item in env.task.records]
    assert all(total > 0 for total in totals)
    assert sum(total == 5 for total in totals) >= 75
    for split, size in {"train": 50, "eval": 16, "test": 16}.items():
        assert (
            llm_marl_envs.make("coophumaneval-v2", data=coophumaneval_file, split=split).num_items
            == size
        )
    guesses = [
        {"aux": TRIVIAL_AUX, "main": f"def {item['entry_point']}(*args):\n    return aux(args[0])"}
        for item in env.task.records
    ]
    for item, total, (_, rewards, _, _, infos) in zip(
        env.task.records, totals, step_all(env, guesses), strict=True
    ):
        info = infos["main"]
        assert info["tests_total"] == total
        assert 0 <= info["tests_passed"] <= total
        assert info["main_calls_aux"] and info["main_is_thin_wrapper"], item["task_id"]
        assert 1.5 <= rewards["main"] <= 4.0


PROMPT = 'def add(a, b):\n    """Add two numbers."""\n'
TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n"


@pytest.mark.parametrize(
    "aux,main,expected",
    [
        # aux has a return, main has none: structure stops the sum after aux's 0.4
        (TRIVIAL_AUX, "def add(a, b):\n    print(a + b)", 0.4),
        # both return, but the program does not parse (broken aux): 0.4 + 0.6
        ("def aux(x):\n    return (x", "def add(a, b):\n    return a + b", 1.0),
        # correct and independent of aux: 0.4 + 0.6 + 0.5 + 1.0
        (TRIVIAL_AUX, "def add(a, b):\n    return a + b", 2.5),
        # correct, calls aux usefully: + 0.5 + 1.0
        (
            "def aux(a, b):\n    return a + b",
            "def add(a, b):\n    total = aux(a, b)\n    return int(total)",
            4.0,
        ),
        # a thin wrapper: only + 0.5
        ("def aux(a, b):\n    return a + b", "def add(a, b):\n    return aux(a, b)", 3.0),
        # calls aux and ignores it: + 0.5 + 1.0 - 0.5
        (TRIVIAL_AUX, "def add(a, b):\n    aux(a)\n    return a + b", 3.5),
        # all tests fail: no cooperation bonus even though main calls aux
        (
            "def aux(a, b):\n    return a - b",
            "def add(a, b):\n    s = aux(a, b)\n    return s + 1",
            1.5,
        ),
        # markdown fences and prose around the code are fine
        (
            "Here you go:\n```python\ndef aux(a, b):\n    return a + b\n```\nHope it helps",
            "```python\ndef add(a, b):\n    result = aux(a, b)\n    return result * 1\n```",
            4.0,
        ),
    ],
)
def test_coding_reward_levels(aux, main, expected):
    score = score_coding(PROMPT, TEST, "add", aux, main)
    assert sum(score.parts.values()) == pytest.approx(expected), score.parts


def test_extraction_keeps_syntax_errors_visible_and_drops_demo_calls():
    broken = extract_definitions("def f(x):\n    return (x\n\nprint(f(1))", "f")
    assert broken.target is None and "return (x" in broken.target_source
    demo = extract_definitions("def f(x):\n    return x\n\nprint(f(1))\nimport os", "f")
    assert "print" not in demo.source and "import os" in demo.source
    assert isinstance(demo.target, ast.FunctionDef)
    renamed = extract_definitions(
        "def aux(x):\n    return 1\n\ndef f(x):\n    return 2", "f", exclude=frozenset({"aux"})
    )
    assert "aux" not in renamed.source


def test_aux_usage_patterns():
    def usage(code):
        return aux_usage(ast.parse(code).body[0])

    assert usage("def f(x):\n    '''doc'''\n    return aux(x)").thin_wrapper
    assert usage("def f(x):\n    y = aux(x)\n    return y").thin_wrapper
    assert not usage("def f(x):\n    y = aux(x)\n    return y + 1").thin_wrapper
    assert usage("def f(x):\n    aux(x)\n    return x").ignores_result
    assert not usage("def f(x):\n    aux(x)\n    return aux(x) + 1").ignores_result
    assert usage("def f(x):\n    _ = aux(x)\n    return x").ignores_result  # stored, never read
    assert not usage("def f(x):\n    y = aux(x)\n    return x + y").ignores_result
    assert not usage("def f(x):\n    return x").calls_aux


def test_code_region_pairs_fences_and_keeps_code_before_an_unopened_fence():
    from llm_marl_envs.rewards.code_analysis import code_region

    assert code_region("Here:\n```python\ndef f():\n    return 1\n```\nDone.") == (
        "def f():\n    return 1"
    )
    # began inside the block: the code is before the lone fence, prose after it
    assert code_region("def f():\n    return 1\n```\nThis returns one.") == (
        "def f():\n    return 1"
    )
    # a block left open runs to the end
    assert code_region("Sure.\n```python\ndef f():\n    return 1") == "def f():\n    return 1"
    two = code_region("```python\nimport os\n```\ntext\n```\ndef g():\n    pass\n```")
    assert two == "import os\ndef g():\n    pass"
    assert code_region("def f():\n    return 1\n") == "def f():\n    return 1\n"
