"""benchmarks/cut_off_answers.py: which answers of a result were cut off, and which loop."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "cut_off_answers.py"
spec = importlib.util.spec_from_file_location("cut_off_answers", SCRIPT)
cut_off_answers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cut_off_answers)


def test_a_learning_result_marks_the_longest_answers_of_a_joint_as_cut_off():
    result = {
        "train_config": {"model": None, "max_new_tokens": 10},
        "answers": {"0": [
            {"problem": 0, "sample": 0, "cut off": 0.5, "texts": {"aux": "a" * 10, "main": "b"}},
            {"problem": 0, "sample": 1, "cut off": 0.0, "texts": {"aux": "a" * 9, "main": "b"}},
        ]},
    }  # fmt: skip
    answers = cut_off_answers.sampled_answers(result, "0", len)
    assert cut_off_answers.settings(result) == (None, 10)
    assert [(a["agent"], a["cut"], a["tokens"]) for a in answers] == [
        ("aux", True, 10), ("main", False, 1), ("aux", False, 9), ("main", False, 1)
    ]  # fmt: skip


def test_an_untrained_result_keeps_its_own_flags():
    result = {
        "model": {"id": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "config": {"max_new_tokens": 512},
        "samples": [{"index": 3, "sample": 1, "texts": {"aux": "x", "main": "yy"},
                     "cut": {"aux": False, "main": True}}],
    }  # fmt: skip
    answers = cut_off_answers.sampled_answers(result, "0", len)
    assert cut_off_answers.settings(result) == ("HuggingFaceTB/SmolLM2-135M-Instruct", 512)
    assert [a["cut"] for a in answers] == [False, True]
    assert answers[1]["problem"] == 3 and answers[1]["tokens"] == 2


def test_a_learning_record_with_its_own_flags_keeps_them():
    record = {"problem": 0, "sample": 0, "cut off": 0.5, "texts": {"aux": "a" * 10, "main": "b"},
              "cut": {"aux": False, "main": True}}  # fmt: skip
    answers = cut_off_answers.sampled_answers({"answers": {"0": [record]}}, "0", len)
    assert [a["cut"] for a in answers] == [False, True]


def test_a_loop_repeats_its_own_last_40_characters():
    line = "def helper(x):\n    return helper(x)\n"
    assert cut_off_answers.repeats("Here is the code.\n" + line * 5)
    assert not cut_off_answers.repeats("def f(x):\n    return [i * i for i in range(x)]")
    assert not cut_off_answers.repeats(line[:30])
