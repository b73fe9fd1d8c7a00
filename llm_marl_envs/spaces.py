"""Spaces for natural-language observations and actions.

Gymnasium's ``Text`` space only accepts strings drawn from a fixed charset (alphanumerics by
default), so it rejects what language models actually write: newlines, punctuation, quotes,
code, emoji. PettingZoo's API test checks every observation with ``contains``; with the stock
space, every real observation would fail it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.spaces import Text


class TextObservation(str):
    """A ``str`` that also carries the ``dtype`` of gymnasium's text spaces.

    PettingZoo's AEC API test compares ``observation.dtype`` with ``space.dtype``, which a plain
    ``str`` lacks. This subclass adds that one attribute and is otherwise an ordinary string:
    equal to, hashing like and serialising like the plain text.
    """

    __slots__ = ()
    dtype = np.dtype(str)


class UnicodeText(Text):
    """Any Python ``str`` whose length lies in ``[min_length, max_length]``.

    ``sample`` still draws from the (alphanumeric) charset of the parent class, seeded through
    the space's own ``np_random``, so sampled actions are reproducible.
    """

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | None = None):
        super().__init__(max_length, min_length=min_length, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"

    def __eq__(self, other: Any) -> bool:
        return (
            isinstance(other, UnicodeText)
            and self.min_length == other.min_length
            and self.max_length == other.max_length
        )

    __hash__ = None  # type: ignore[assignment]  # mutable RNG inside, like every gymnasium space
