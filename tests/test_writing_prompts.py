"""The writing tasks' prompt styles: the paper's prompts by default, which state none of the
reward's targets, and the explicit-targets variant, which states the word range."""

import json
import math
import re

import pytest
from conftest import DATA

from llm_marl_envs.data import Records
from llm_marl_envs.errors import ConfigError
from llm_marl_envs.tasks.writing import PROMPT_STYLES, ArxivTask, TldrTask


def first_record(name: str) -> dict:
    return json.loads((DATA / name).read_text().splitlines()[0])


TLDR_ITEM = first_record("tldr_sample.jsonl")
ARXIV_ITEM = first_record("arxiv_sample.jsonl")
CASES = [(TldrTask, TLDR_ITEM), (ArxivTask, ARXIV_ITEM)]
# a few of each reward's numbers, to be sure reward_numbers() finds them
SPEC_NUMBERS = {TldrTask: {"8", "256", "1.6", "3.2", "0.03"}, ArxivTask: {"128", "256", "1.3"}}
NUMBER_WORDS = {
    "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twenty",
    "fifty", "hundred", "twice", "double", "half",
}  # fmt: skip


def make(task_class, item, **options):
    return task_class(Records([item], "test"), **options)


def template_text(task, item) -> dict[str, str]:
    """Each role's prompt with the source document cut out: what the task itself says."""
    source = item[task.source_field].strip()
    prompts = task.prompts(item)
    assert all(prompt.count(source) == 1 for prompt in prompts.values())
    return {role: prompt.replace(source, "") for role, prompt in prompts.items()}


def reward_numbers(spec) -> set[str]:
    """Every number the reward checks, written as a prompt would write it."""
    bands = (spec.length_band, spec.vocabulary_band)
    values = [*spec.word_range, spec.jaccard_cap]
    values += [getattr(band, name) for band in bands for name in vars(band)]
    return {f"{value:g}" for value in values if math.isfinite(value)}


def test_every_task_offers_every_style_for_every_role():
    assert PROMPT_STYLES[0] == "paper"
    for task_class, _ in CASES:
        assert tuple(task_class.prompt_styles) == PROMPT_STYLES
        for templates in task_class.prompt_styles.values():
            assert tuple(templates) == task_class.roles


@pytest.mark.parametrize("task_class,item", CASES)
def test_paper_prompts_are_the_default_and_state_no_target(task_class, item):
    task = make(task_class, item)
    assert task.prompt_style == "paper"
    numbers = reward_numbers(task.reward_spec)
    assert SPEC_NUMBERS[task_class] <= numbers
    for role, text in template_text(task, item).items():
        assert not re.search(r"\d", text), role
        assert not any(number in text for number in numbers), role
        assert not re.search(r"\b(times|ratio|as long as|length)\b", text, re.I), role
        counted = re.findall(r"(\w+)[\s-]+(?:words|tokens|characters)\b", text.lower())
        assert not set(counted) & NUMBER_WORDS, role


def test_paper_prompts_are_the_authors():
    task = make(TldrTask, TLDR_ITEM)
    source = TLDR_ITEM["prompt"].strip()
    assert task.prompts(TLDR_ITEM)["detailed"] == (
        "Create a detailed summary response to this post.\n\n"
        f"Original Query:\n{source}\n\n"
        "IMPORTANT INSTRUCTIONS:\n"
        "- Use more unique words\n"
        "- Use some transition words to improve flow\n"
    )
    concise = task.prompts(TLDR_ITEM)["concise"]
    assert concise.startswith("Create a concise summary response to this post.")
    arxiv = make(ArxivTask, ARXIV_ITEM).prompts(ARXIV_ITEM)
    assert "- You just need to focus on background and motivation\n" in arxiv["background"]
    assert "- You just need to focus on methodology and implications\n" in arxiv["method"]


@pytest.mark.parametrize("task_class,item", CASES)
def test_word_options_change_the_reward_not_the_paper_prompts(task_class, item):
    default = make(task_class, item)
    custom = make(task_class, item, min_words=20, max_words=90)
    assert custom.prompts(item) == default.prompts(item)
    assert custom.reward_spec.word_range == (20, 90)


def test_explicit_targets_render_as_before():
    task = make(TldrTask, TLDR_ITEM, prompt_style="explicit-targets")
    source = TLDR_ITEM["prompt"].strip()
    assert task.prompts(TLDR_ITEM)["concise"] == (
        "Summarise the following Reddit post in one or two short sentences (8-256 words). "
        "A teammate writes a longer, detailed summary of the same post; yours is the concise "
        f"one.\n\n{source}\n\nConcise summary:"
    )
    assert "(8-256 words), about two to three times as long" in task.prompts(TLDR_ITEM)["detailed"]
    arxiv = make(ArxivTask, ARXIV_ITEM, prompt_style="explicit-targets", max_words=300)
    for prompt in arxiv.prompts(ARXIV_ITEM).values():
        assert "introduction (128-300 words)" in prompt
        assert prompt.endswith(("\n\nBackground:", "\n\nMethodology:"))


@pytest.mark.parametrize("style", ["explicit", "Paper", None])
def test_unknown_prompt_style_names_the_known_ones(style):
    with pytest.raises(ConfigError) as caught:
        make(TldrTask, TLDR_ITEM, prompt_style=style)
    message = str(caught.value)
    assert repr(style) in message
    assert all(repr(name) in message for name in PROMPT_STYLES)
