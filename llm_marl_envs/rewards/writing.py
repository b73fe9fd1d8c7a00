"""The gated joint reward of the two writing tasks (docs/reference.md §3.1 and §3.2).

Four levels are summed in order and a level that scores 0 ends the sum, so the agents must
first get the format right (level 1), then the relation between their lengths (2), then their
vocabularies (3), before style (4) counts at all:

1. structure, 0.5: both texts have a word count within ``word_range`` and are written in the
   agents' own words: at most ``max_copied_share`` of each text's runs of six words occur
   word for word in the source (the post or the abstract);
2. length, up to 1.0: the character ratio second/first inside a trapezoidal band;
3. vocabulary, up to 0.5: the unique-word ratio second/first inside another band;
4. coherence, up to 0.4 (transition phrases), and consistency, up to 0.6 (Jaccard overlap of
   content words, saturating at ``jaccard_cap``).

Differences from the reference implementation:

- transition phrases match whole words only ("as" no longer matches inside "was"), see
  ``lexicon.py``;
- the copy check of level 1. The reference reward compares the two texts with each other,
  never with the source, so pasting the source scores near the maximum: both arXiv agents
  pasting the abstract earn 2.8 of 3.0, and on TLDR a "concise" first 40 words and a
  "detailed" first 200 words of the post earn 2.7-2.8 (tests/test_writing_rewards.py).
  ``max_copied_share=None`` restores the reference reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .text import (
    content_words,
    copied_share,
    jaccard,
    ratio,
    transition_categories,
    transition_score,
    unique_words,
    word_count,
)

STRUCTURE_WEIGHT = 0.5
LENGTH_WEIGHT = 1.0
VOCABULARY_WEIGHT = 0.5
COHERENCE_WEIGHT = 0.4
CONSISTENCY_WEIGHT = 0.6
MAX_WRITING_REWARD = (
    STRUCTURE_WEIGHT + LENGTH_WEIGHT + VOCABULARY_WEIGHT + COHERENCE_WEIGHT + CONSISTENCY_WEIGHT
)
PART_NAMES = ("structure", "length", "vocabulary", "coherence", "consistency")


@dataclass(frozen=True)
class Band:
    """A trapezoid: 0 up to ``rise_from``, rising to 1 at ``plateau_from``, 1 through
    ``plateau_to``, falling to 0 at ``fall_to`` (use ``math.inf`` for an open top)."""

    rise_from: float
    plateau_from: float
    plateau_to: float = math.inf
    fall_to: float = math.inf

    def __call__(self, value: float) -> float:
        if self.plateau_from <= value <= self.plateau_to:
            return 1.0
        if self.rise_from <= value < self.plateau_from:
            return (value - self.rise_from) / (self.plateau_from - self.rise_from)
        if self.plateau_to < value <= self.fall_to:
            return (self.fall_to - value) / (self.fall_to - self.plateau_to)
        return 0.0

    def describe(self) -> str:
        top = "" if math.isinf(self.plateau_to) else f"-{self.plateau_to:g}"
        return f"{self.plateau_from:g}{top}"


@dataclass(frozen=True)
class WritingRewardSpec:
    """The numbers that distinguish one writing task's reward from another's."""

    word_range: tuple[int, int]
    length_band: Band
    vocabulary_band: Band
    jaccard_cap: float
    transitions_in_both: bool  # arXiv scores the joint text, TLDR only the second (detailed) one
    #: Level 1 fails for a text whose share of six-word runs copied from the source is above
    #: this; None: no check (the reference reward, which pays a pasted source).
    max_copied_share: float | None = 0.5


TLDR_REWARD = WritingRewardSpec(
    word_range=(8, 256),
    length_band=Band(1.1, 1.6, 3.2, 5.0),
    vocabulary_band=Band(1.3, 2.0),
    jaccard_cap=0.03,
    transitions_in_both=False,
)

ARXIV_REWARD = WritingRewardSpec(
    word_range=(128, 256),
    length_band=Band(0.8, 1.0, 1.3, 1.5),
    vocabulary_band=Band(0.5, 0.7, 1.3, 1.7),
    jaccard_cap=0.23,
    transitions_in_both=True,
)


@dataclass(frozen=True)
class WritingScore:
    parts: dict[str, float]
    measurements: dict[str, float | int]
    failed_level: str | None  # the level that ended the sum, None when all four counted


def score_writing(first: str, second: str, spec: WritingRewardSpec, *, source: str) -> WritingScore:
    """Score two texts written from ``source``; ``first`` is the shorter role's (concise /
    background)."""
    parts = dict.fromkeys(PART_NAMES, 0.0)
    low, high = spec.word_range
    words = (word_count(first), word_count(second))
    copied = (copied_share(first, source), copied_share(second, source))
    measurements: dict[str, float | int] = {
        "words_first": words[0],
        "words_second": words[1],
        "copied_first": round(copied[0], 6),
        "copied_second": round(copied[1], 6),
    }
    in_own_words = spec.max_copied_share is None or max(copied) <= spec.max_copied_share
    if not (in_own_words and all(low <= count <= high for count in words)):
        return WritingScore(parts, measurements, "structure")
    parts["structure"] = STRUCTURE_WEIGHT

    length_ratio = ratio(len(second), len(first))
    measurements["length_ratio"] = round(length_ratio, 6)
    parts["length"] = LENGTH_WEIGHT * spec.length_band(length_ratio)
    if parts["length"] == 0.0:
        return WritingScore(parts, measurements, "length")

    vocabulary_ratio = ratio(len(unique_words(second)), len(unique_words(first)))
    measurements["vocabulary_ratio"] = round(vocabulary_ratio, 6)
    parts["vocabulary"] = VOCABULARY_WEIGHT * spec.vocabulary_band(vocabulary_ratio)
    if parts["vocabulary"] == 0.0:
        return WritingScore(parts, measurements, "vocabulary")

    styled = f"{first}\n{second}" if spec.transitions_in_both else second
    overlap = jaccard(content_words(first), content_words(second))
    measurements["transition_categories"] = len(transition_categories(styled))
    measurements["jaccard"] = round(overlap, 6)
    parts["coherence"] = COHERENCE_WEIGHT * transition_score(styled)
    parts["consistency"] = CONSISTENCY_WEIGHT * min(overlap, spec.jaccard_cap) / spec.jaccard_cap
    return WritingScore(parts, measurements, None)


def writing_feedback(score: WritingScore, spec: WritingRewardSpec, roles: tuple[str, str]) -> str:
    """Tell the agents which level stopped them and what was measured, in plain words."""
    first, second = roles
    m = score.measurements
    low, high = spec.word_range
    lines = [
        f"Word counts: {first} {m['words_first']}, {second} {m['words_second']} "
        f"(each must be {low}-{high})."
    ]
    if spec.max_copied_share is not None:
        lines.append(
            f"Copied word for word from the source: {first} {m['copied_first']:.0%}, "
            f"{second} {m['copied_second']:.0%} (each at most {spec.max_copied_share:.0%})."
        )
    if "length_ratio" in m:
        lines.append(
            f"Length ratio {second}/{first}: {m['length_ratio']:.2f} "
            f"(best {spec.length_band.describe()})."
        )
    if "vocabulary_ratio" in m:
        lines.append(
            f"Unique-word ratio {second}/{first}: {m['vocabulary_ratio']:.2f} "
            f"(best {spec.vocabulary_band.describe()})."
        )
    if "jaccard" in m:
        lines.append(
            f"Transition-phrase categories used: {m['transition_categories']}; "
            f"shared content words (Jaccard): {m['jaccard']:.3f}."
        )
    if score.failed_level is None:
        lines.append("Every level was reached; improve style to raise the reward.")
    else:
        lines.append(f"The '{score.failed_level}' level failed, so later levels scored 0.")
    return "\n".join(lines)
