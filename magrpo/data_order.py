"""The order in which training visits the dataset: seeded, reshuffled every epoch, and
resumable from a checkpoint."""

from __future__ import annotations

import math

import numpy as np

from magrpo.config import ConfigError


class DataOrder:
    """Dataset indices in a seeded shuffled order, epoch after epoch (None: seeds only)."""

    def __init__(self, num_items: int | None, seed: int):
        self.num_items = num_items
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.consumed = 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_items)

    def next(self) -> tuple[int | None, int]:
        """(dataset index or None, reset seed) of the next episode root."""
        reset_seed = (self.seed * 1_000_003 + self.consumed) % (2**31 - 1)
        self.consumed += 1
        if self.num_items is None:
            return None, reset_seed
        index = int(self._order()[self.position])
        self.position += 1
        if self.position == self.num_items:
            self.epoch, self.position = self.epoch + 1, 0
        return index, reset_seed

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self.consumed = (
            state["epoch"],
            state["position"],
            state["consumed"],
        )


def total_steps(
    num_items: int | None, max_steps: int | None, num_epochs: float | None, prompts_per_step: int
) -> int:
    """Training steps: ``max_steps``, or the steps of ``num_epochs`` passes over ``num_items``
    (whichever comes first when both are set)."""
    if num_epochs is None:
        return int(max_steps)
    if num_items is None:
        if max_steps is None:
            raise ConfigError(
                "num_epochs needs an env with an integer num_items (a dataset size); this env "
                "has none: set --max-steps instead."
            )
        return int(max_steps)
    epoch_steps = math.ceil(num_epochs * num_items / prompts_per_step)
    return min(epoch_steps, max_steps) if max_steps else epoch_steps
