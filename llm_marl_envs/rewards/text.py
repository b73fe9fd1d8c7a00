"""Text measurements of the writing rewards (docs/reference.md §3: words are whitespace tokens,
lengths are characters, unique words are distinct lower-cased ``\\w+`` words)."""

from __future__ import annotations

import functools
import re

from .lexicon import STOPWORDS, TRANSITION_CATEGORIES

_WORD = re.compile(r"\w+")


def word_count(text: str) -> int:
    return len(text.split())


def unique_words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def content_words(text: str) -> set[str]:
    return unique_words(text) - STOPWORDS


def jaccard(first: set[str], second: set[str]) -> float:
    union = first | second
    return len(first & second) / len(union) if union else 0.0


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; 0 for a zero denominator (the level fails, no crash)."""
    return numerator / denominator if denominator else 0.0


@functools.cache
def _category_patterns() -> dict[str, re.Pattern[str]]:
    """One regex per category; a phrase matches only between non-word characters."""
    return {
        name: re.compile(
            r"(?<!\w)(?:"
            + "|".join(re.escape(p) for p in sorted(phrases, key=len, reverse=True))
            + r")(?!\w)"
        )
        for name, phrases in TRANSITION_CATEGORIES.items()
    }


#: Words per run compared with the source: six words in a row are rarely shared by chance
#: (untrained TLDR summaries share 12-14% of their runs with the post), but a pasted sentence is.
COPY_RUN_WORDS = 6


def word_runs(text: str, size: int = COPY_RUN_WORDS) -> list[tuple[str, ...]]:
    """The overlapping runs of ``size`` words of ``text`` (lower-cased ``\\w+`` words)."""
    words = _WORD.findall(text.lower())
    return [tuple(words[i : i + size]) for i in range(len(words) - size + 1)]


def copied_share(text: str, source: str) -> float:
    """Share of ``text``'s runs of six words that occur word for word in ``source``: 0 for a
    text in its own words (or of fewer than six words), 1 for a copy."""
    runs = word_runs(text)
    if not runs:
        return 0.0
    in_source = set(word_runs(source))
    return sum(run in in_source for run in runs) / len(runs)


def transition_categories(text: str) -> list[str]:
    """The categories of transition phrases that occur in ``text`` (whole words, any case)."""
    lowered = " ".join(text.lower().split())
    return [name for name, pattern in _category_patterns().items() if pattern.search(lowered)]


def transition_score(text: str) -> float:
    """0 with no category present; else 0.4 for one, +0.05 per further category, capped at 1."""
    present = len(transition_categories(text))
    return 0.0 if present == 0 else min(0.4 + 0.05 * (present - 1), 1.0)
