"""What the coding agents see: the problem as text for the helper, one contract for both, and
feedback that does not hand out the tests."""

from __future__ import annotations

import ast

import pytest
from conftest import DATA

import llm_marl_envs
from llm_marl_envs.tasks.coding import problem_text


def first_observations(env_id: str, index: int, **kwargs) -> tuple[dict, dict]:
    env = llm_marl_envs.make(env_id, **kwargs)
    observations, _ = env.reset(options={"index": index})
    return observations, env.task.records[index]


@pytest.mark.parametrize("index", [0, 32, 115, 163])
def test_helper_sees_no_stub_and_ends_in_the_aux_skeleton(index: int) -> None:
    observations, item = first_observations("humaneval-v2", index, split="all")
    helper, main = observations["aux"], observations["main"]
    entry_point = item["entry_point"]
    assert f"def {entry_point}" not in helper  # nothing to complete but aux
    assert helper.rstrip().endswith("    ...\n    return result\n```")
    skeleton = helper[helper.rindex("```python") + len("```python") :].rsplit("```", 1)[0]
    function = ast.parse(skeleton.replace("...", "pass")).body[0]
    assert isinstance(function, ast.FunctionDef) and function.name == "aux"
    text = problem_text(item["prompt"], entry_point)
    assert text.docstring.splitlines()[0] in helper
    # both agents are told the same contract, so main can call aux without seeing it
    contract = f"`aux({text.call})` takes the same arguments as `{entry_point}`"
    assert contract in helper and contract in main
    assert item["prompt"].strip() in main  # main keeps its stub: it should complete it


@pytest.mark.parametrize("index", [0, 32, 115, 163])
def test_main_ends_in_its_stub_with_a_call_of_aux(index: int) -> None:
    observations, item = first_observations("humaneval-v2", index, split="all")
    main, entry_point = observations["main"], item["entry_point"]
    call = problem_text(item["prompt"], entry_point).call
    assert f"Call `aux({call})` inside `{entry_point}` and use its result" in main
    assert main.endswith(f"    result = aux({call})\n    ...\n    return answer")
    skeleton = main[main.index(item["prompt"].strip()) :]  # the stub, then the call of aux
    tree = ast.parse(skeleton.replace("...", "pass"))
    function = tree.body[-1]  # the call is inside the entry point, below its docstring
    assert isinstance(function, ast.FunctionDef) and function.name == entry_point
    calls = [node for node in ast.walk(function) if isinstance(node, ast.Call)]
    assert [ast.unparse(node) for node in calls] == [f"aux({call})"]
    assert "aux" not in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def test_problem_text_splits_signature_docstring_and_context() -> None:
    prompt = (
        "import math\n\n\ndef helper(x):\n    return x\n\n\n"
        "def f(a: int, *rest, key=None, **options) -> list:\n"
        '    """Do the thing.\n\n    >>> f(1)\n    [1]\n    """\n'
    )
    text = problem_text(prompt, "f")
    assert text.signature == "(a: int, *rest, key=None, **options) -> list"
    assert text.call == "a, *rest, key=key, **options"
    assert text.docstring == "Do the thing.\n\n>>> f(1)\n[1]"
    assert "import math" in text.context and "def helper" in text.context
    assert "def f" not in text.context


def test_malformed_problem_is_refused_when_the_env_is_made(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"task_id": "x/0", "prompt": "def g():\\n    pass\\n", "test": "def check(c):\\n'
        '    assert c() == 1\\n", "entry_point": "f"}\n'
    )
    with pytest.raises(llm_marl_envs.DataFormatError, match="entry point 'f'"):
        llm_marl_envs.make("coophumaneval-v2", data=bad, split="all")


def test_feedback_shows_one_failing_assert_and_the_types_of_the_others() -> None:
    env = llm_marl_envs.make("coophumaneval-v2", data=DATA / "coding_sample.jsonl", split="all",
                             max_turns=2)
    env.reset(options={"index": 0})
    wrong = {"aux": "def aux(text):\n    return 0",
             "main": "def count_vowels(text):\n    return -1"}
    observations, *_ , infos = env.step(wrong)
    feedback = observations["main"].split("Feedback on the team's previous attempt:")[1]
    total = infos["main"]["tests_total"]
    assert f"Tests passed: 0/{total}." in feedback
    assert feedback.count("Failed: assert") == 1
    assert f"Other failing tests: AssertionError x{total - 1}." in feedback

    env = llm_marl_envs.make("coophumaneval-v2", data=DATA / "coding_sample.jsonl", split="all",
                             max_turns=2, feedback_failures=0)
    env.reset(options={"index": 0})
    observations, *_ = env.step(wrong)
    assert "Failed: assert" not in observations["main"]
    with pytest.raises(llm_marl_envs.ConfigError, match="feedback_failures"):
        llm_marl_envs.make("humaneval-v2", feedback_failures=-1)


@pytest.mark.parametrize("env_id", ["humaneval-v2", "coophumaneval-v2"])
def test_coding_envs_declare_where_an_answer_ends(env_id: str) -> None:
    kwargs = {"data": DATA / "coding_sample.jsonl", "split": "all"} if "coop" in env_id else {}
    env = llm_marl_envs.make(env_id, **kwargs)
    for agent in env.possible_agents:
        answer_format = env.metadata["answer_format"][agent]
        assert answer_format["stop"] == ["\n```\n"] and answer_format["max_tokens"] == 384
        answer = "```python\ndef aux(x):\n    return x\n```\nThis returns x."
        cut = answer.index(answer_format["stop"][0]) + len(answer_format["stop"][0])
        assert "```python" not in answer_format["stop"][0]  # the opening fence does not stop
        assert answer[:cut].endswith("return x\n```\n")
