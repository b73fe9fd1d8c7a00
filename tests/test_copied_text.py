"""benchmarks/copied_text.py: the copied share of stored answers and their rescoring."""

import json
from pathlib import Path

import pytest

import llm_marl_envs

DATA = Path(__file__).parent / "data" / "tldr_sample.jsonl"


@pytest.fixture
def copied_text(benchmark_script):
    return benchmark_script("copied_text")


def stored_results(own_words: dict[str, str], pasted: dict[str, str]) -> dict:
    """learning.py's results for one problem: step 0 in the agents' own words, step 40 with
    the detailed summary pasted from the post, as a `tldr-v1` run stored them."""
    return {
        "env": "tldr-v1",
        "eval_split": "all",
        "answers": {
            "0": [{"problem": 0, "sample": 0, "texts": own_words}],
            "40": [{"problem": 0, "sample": 0, "texts": pasted}],
        },
    }


def test_a_pasted_post_is_measured_as_copied_and_rescored_by_the_newest_env(copied_text):
    post = llm_marl_envs.make("tldr", data=DATA, split="all").task.records[0]["prompt"]
    concise = "My roommate keeps eating my food and denies it; how do I raise it calmly?"
    detailed = (
        "For two months, her groceries have vanished from the apartment she shares with a "
        "coworker. Although she labelled everything, the roommate denies it. However, she "
        "found her own container washed and returned, so she spends forty extra dollars a week."
    )
    pasted = " ".join(post.split()[:200])
    results = stored_results(
        {"concise": concise, "detailed": detailed}, {"concise": concise, "detailed": pasted}
    )
    env = copied_text.newest_env(results, str(DATA))
    assert env.metadata["name"] == "tldr-v2"
    report = copied_text.copied_by_step(results, env)
    assert report["0"]["detailed"]["value"] < 0.2
    assert report["40"]["detailed"]["value"] > 0.9
    assert report["40"]["detailed"]["change"]["value"] > 0.7
    reward = report["40"]["joint reward, tldr-v2"]
    assert reward["value"] == 0.0 and reward["change"]["value"] < 0


def test_the_report_names_the_columns_and_the_changes(copied_text, tmp_path, capsys):
    post = llm_marl_envs.make("tldr", data=DATA, split="all").task.records[0]["prompt"]
    texts = {"concise": "A short summary of the post.", "detailed": post}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(stored_results(texts, texts)))
    copied_text.main([str(path), "--data", str(DATA)])
    out = capsys.readouterr().out
    assert "| step | concise | instruction lines, concise | detailed |" in out
    assert "| joint reward, tldr-v2 | tldr-v2 without instruction lines |" in out
    assert "| 40 | " in out and "(+0.00 ± 0.00)" in out


def test_instruction_lines_are_counted_and_removed_before_rescoring(copied_text):
    summary = "My roommate keeps eating my food and denies it; how do I raise it calmly?"
    padded = summary + "\n\n- Provide a brief and focused summary\n- offer a few examples"
    assert copied_text.instruction_lines(padded) == [
        "- Provide a brief and focused summary",
        "- offer a few examples",
    ]
    assert copied_text.without_instruction_lines(padded) == summary
    # a bullet that states a fact, or a word that only starts like a verb, is not an instruction
    assert copied_text.instruction_lines("- She labelled everything\n- Adding: rice went too") == []

    detailed = "Her roommate eats her food and denies it. " * 6
    results = stored_results(
        {"concise": summary, "detailed": detailed}, {"concise": padded, "detailed": detailed}
    )
    report = copied_text.copied_by_step(results, copied_text.newest_env(results, str(DATA)))
    assert report["0"]["instruction lines, concise"]["value"] == 0.0
    assert report["40"]["instruction lines, concise"]["value"] == 1.0
    assert report["40"]["instruction lines, detailed"]["value"] == 0.0
    with_lines = report["40"]["joint reward, tldr-v2"]["value"]
    without = report["40"]["tldr-v2 without instruction lines"]["value"]
    assert without == report["0"]["joint reward, tldr-v2"]["value"]
    assert with_lines != without
