"""Every level boundary of the writing rewards (docs/reference.md §3.1, §3.2)."""

import math
import re
from pathlib import Path

import pytest

import llm_marl_envs
from llm_marl_envs.errors import ConfigError
from llm_marl_envs.rewards.lexicon import STOPWORDS, TRANSITION_CATEGORIES
from llm_marl_envs.rewards.text import (
    content_words,
    copied_share,
    jaccard,
    transition_categories,
    transition_score,
)
from llm_marl_envs.rewards.writing import ARXIV_REWARD, TLDR_REWARD, score_writing

DATA = Path(__file__).parent / "data"


def _code(number: int) -> str:
    letters = ""
    number += 1
    while number:
        number, rest = divmod(number - 1, 26)
        letters = "bcdfghjklmnpqrstvwxzyaeiou"[rest] + letters
    return letters


def sized(words: int, chars: int, unique: int, prefix: str) -> str:
    """A text with exactly ``words`` words, ``chars`` characters and ``unique`` distinct words.

    The first word occurs once, so it can be lengthened to reach ``chars`` without changing
    the number of distinct words.
    """
    vocabulary = [f"{prefix}{_code(i)}" for i in range(unique)]
    tokens = [vocabulary[0]] + [vocabulary[1 + i % (unique - 1)] for i in range(words - 1)]
    missing = chars - len(" ".join(tokens))
    assert missing >= 0, "chars too small for that many words"
    tokens[0] += "x" * missing
    text = " ".join(tokens)
    assert len(text) == chars and len(text.split()) == words
    assert len(set(text.lower().split())) == unique
    return text


def tldr(length_ratio: float = 2.0, vocab_ratio: float = 2.5) -> dict:
    first = sized(20, 400, 20, "zq")
    second = sized(60, round(400 * length_ratio), round(20 * vocab_ratio), "vk")
    return score_writing(first, second, TLDR_REWARD, source="").parts


@pytest.mark.parametrize(
    "words,passes",
    [((8, 30), True), ((7, 30), False), ((10, 256), True), ((10, 257), False), ((257, 30), False)],
)
def test_tldr_structure_bounds(words, passes):
    first = sized(words[0], max(700, 6 * words[0]), min(words[0], 10), "zq")
    second = sized(words[1], 2 * len(first), min(words[1], 25), "vk")
    parts = score_writing(first, second, TLDR_REWARD, source="").parts
    assert parts["structure"] == (0.5 if passes else 0.0)
    if not passes:
        assert sum(parts.values()) == 0.0


@pytest.mark.parametrize(
    "ratio,expected",
    [
        (1.05, 0.0),
        (1.1, 0.0),
        (1.35, 0.5),
        (1.6, 1.0),
        (2.5, 1.0),
        (3.2, 1.0),
        (4.1, 0.5),
        (5.0, 0.0),
        (5.5, 0.0),
    ],
)
def test_tldr_length_ratio_band(ratio, expected):
    parts = tldr(length_ratio=ratio)
    assert parts["length"] == pytest.approx(expected)
    if expected == 0.0:  # the level scored 0: the sum stops here
        assert parts["vocabulary"] == parts["coherence"] == parts["consistency"] == 0.0
    else:
        assert parts["vocabulary"] > 0


@pytest.mark.parametrize(
    "ratio,expected", [(1.2, 0.0), (1.3, 0.0), (1.65, 0.25), (2.0, 0.5), (3.0, 0.5)]
)
def test_tldr_vocabulary_ratio_band(ratio, expected):
    parts = tldr(vocab_ratio=ratio)
    assert parts["vocabulary"] == pytest.approx(expected)
    assert parts["length"] == 1.0
    if expected == 0.0:
        assert parts["coherence"] == parts["consistency"] == 0.0


def arxiv(length_ratio: float = 1.1, vocab_ratio: float = 1.0) -> dict:
    first = sized(150, 1500, 50, "zq")
    second = sized(150, round(1500 * length_ratio), round(50 * vocab_ratio), "vk")
    return score_writing(first, second, ARXIV_REWARD, source="").parts


@pytest.mark.parametrize(
    "ratio,expected",
    [
        (0.75, 0.0),
        (0.8, 0.0),
        (0.9, 0.5),
        (1.0, 1.0),
        (1.3, 1.0),
        (1.4, 0.5),
        (1.5, 0.0),
        (1.6, 0.0),
    ],
)
def test_arxiv_length_ratio_band(ratio, expected):
    assert arxiv(length_ratio=ratio)["length"] == pytest.approx(expected)


@pytest.mark.parametrize(
    "ratio,expected",
    [
        (0.4, 0.0),
        (0.5, 0.0),
        (0.6, 0.25),
        (0.7, 0.5),
        (1.3, 0.5),
        (1.5, 0.25),
        (1.7, 0.0),
        (1.8, 0.0),
    ],
)
def test_arxiv_vocabulary_ratio_band(ratio, expected):
    assert arxiv(vocab_ratio=ratio)["vocabulary"] == pytest.approx(expected)


@pytest.mark.parametrize("words,passes", [(127, False), (128, True), (256, True), (257, False)])
def test_arxiv_structure_bounds(words, passes):
    first = sized(words, 10 * words, 50, "zq")
    second = sized(words, 11 * words, 50, "vk")
    parts = score_writing(first, second, ARXIV_REWARD, source="").parts
    assert parts["structure"] == (0.5 if passes else 0)


def test_transition_score_counts_categories_whole_words_only():
    assert transition_score("nothing to see here") == 0.0
    assert transition_score("Therefore it rained.") == pytest.approx(0.4)
    # a phrase listed under two categories counts for both
    assert transition_categories("However it rained.") == ["contrast", "concession"]
    # "was" contains "as", "also" contains "so", "different" contains "if": no match
    assert transition_categories("it was alsoish") == []
    assert transition_categories("a different shadow") == []
    assert transition_categories("late as usual") == ["time"]
    assert transition_categories("in\n  addition") == ["elaboration"]
    text = (
        "Furthermore, for example, in other words, therefore, on the other hand, first, "
        "undoubtedly, in summary, similarly, in spite of, unless, nowadays"
    )
    assert len(transition_categories(text)) == 12
    assert transition_score(text) == pytest.approx(min(0.4 + 0.05 * 11, 1.0))


# The authors' lists (OpenMLRL/LLM_Collab_Writing, rewards/tldr_rewards.py): their category
# names in their order, and how many phrases each holds.
AUTHORS_CATEGORY_SIZES = {
    "elaboration": 21,
    "examples": 22,
    "explanation": 22,
    "cause_effect": 26,
    "contrast": 29,
    "sequence": 33,
    "emphasis": 24,
    "summary": 21,
    "comparison": 17,
    "concession": 19,
    "condition": 19,
    "time": 26,
}


def test_lexicon_is_the_authors():
    sizes = {name: len(phrases) for name, phrases in TRANSITION_CATEGORIES.items()}
    assert sizes == AUTHORS_CATEGORY_SIZES
    assert list(TRANSITION_CATEGORIES) == list(AUTHORS_CATEGORY_SIZES)
    for phrases in TRANSITION_CATEGORIES.values():
        assert len(set(phrases)) == len(phrases)
        # lower-case words and single spaces: what whole-word matching needs, nothing to escape
        assert all(re.fullmatch(r"[a-z]+( [a-z]+)*", phrase) for phrase in phrases)
    assert "be that as it may" in TRANSITION_CATEGORIES["contrast"]
    assert "be that as it may" in TRANSITION_CATEGORIES["concession"]
    assert "when all is said and done" in TRANSITION_CATEGORIES["summary"]
    assert "as" in TRANSITION_CATEGORIES["time"]
    assert "so" in TRANSITION_CATEGORIES["cause_effect"]
    assert "in the event that" in TRANSITION_CATEGORIES["condition"]


def test_stopwords_are_the_authors():
    assert len(STOPWORDS) == 106
    assert {"a", "also", "bad", "first", "good", "great", "right", "your"} <= STOPWORDS
    assert not {"about", "because", "themselves"} & STOPWORDS
    assert content_words("The good results were also new") == {"results"}


def test_style_level_combines_transitions_and_capped_jaccard():
    shared = " ".join(f"common{_code(i)}" for i in range(5))
    first = f"Alpha beta gamma delta epsilon zeta eta theta {shared}."
    detailed_words = " ".join(f"word{_code(i)}" for i in range(40))
    second = f"However, {detailed_words} {shared}; therefore, in summary, done."
    score = score_writing(first, second, TLDR_REWARD, source="")
    assert score.failed_level is None
    overlap = jaccard(
        {w.lower() for w in first.replace(".", "").split()},
        {w.strip(",.;").lower() for w in second.split()}
        - {"however", "therefore", "in", "summary", "done"},
    )
    assert score.measurements["jaccard"] > 0.03 and overlap > 0.03
    assert score.parts["consistency"] == pytest.approx(0.6)  # saturated at the 0.03 cap
    assert score.parts["coherence"] == pytest.approx(0.4 * transition_score(second))
    total = sum(score.parts.values())
    assert math.isclose(
        total,
        0.5 + score.parts["length"] + score.parts["vocabulary"] + score.parts["coherence"] + 0.6,
    )


def test_copied_share_counts_six_word_runs_found_in_the_source():
    source = "the quick brown fox jumps over the lazy dog near the river bank today"
    assert copied_share(source, source) == 1.0
    assert copied_share("An answer in words of its own, nothing taken from it.", source) == 0.0
    assert copied_share("the quick brown fox", source) == 0.0  # under six words: no run
    half = "the quick brown fox jumps over the cat who sleeps all day"  # 2 of 7 runs copied
    assert copied_share(half, source) == pytest.approx(2 / 7)


def pasted_source(env_id: str, index: int):
    """The env, the same env with the paper's reward, and the copying hack: arXiv's two agents
    both paste the abstract; TLDR's concise agent pastes the post's first 40 words and the
    detailed one its first 200."""
    data = DATA / f"{env_id}_sample.jsonl"
    env = llm_marl_envs.make(env_id, data=data, split="all")
    reference = llm_marl_envs.make(env_id, data=data, split="all", max_copied_share=None)
    source = env.task.records[index][env.task.source_field]
    words = source.split()
    first, second = env.possible_agents
    if env_id == "arxiv":
        return env, reference, {first: source, second: source}
    return env, reference, {first: " ".join(words[:40]), second: " ".join(words[:200])}


@pytest.mark.parametrize("env_id", ["tldr", "arxiv"])
@pytest.mark.parametrize("index", [0, 1, 2])
def test_pasting_the_source_earns_nothing(env_id, index):
    """The paper's reward compares the two texts only with each other, so a pasted source
    earns 2.7-2.8 of 3.0 under it (``max_copied_share=None``); the env's reward pays 0."""
    env, reference, actions = pasted_source(env_id, index)
    for scored in (env, reference):
        scored.reset(options={"index": index})
    _, paper_rewards, _, _, _ = reference.step(actions)
    _, rewards, _, _, infos = env.step(actions)
    assert min(paper_rewards.values()) >= 2.7
    assert set(rewards.values()) == {0.0}
    info = next(iter(infos.values()))
    assert info["failed_level"] == "structure" and info["copied_second"] > 0.5


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half", float("nan")])
def test_a_bad_max_copied_share_is_refused(bad):
    with pytest.raises(ConfigError, match="max_copied_share"):
        llm_marl_envs.make("tldr", data=DATA / "tldr_sample.jsonl", max_copied_share=bad)
