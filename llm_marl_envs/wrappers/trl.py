"""Any suite environment as a reward function for TRL's ``GRPOTrainer``.

One model plays every role in one completion (the paper's single-model baseline). The dataset
carries each record's ``index`` so that the reward function scores a completion on exactly
the episode its prompt came from; completions are scored concurrently on branches of the env.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..env import TextParallelEnv
from .joint_text import combine_observations, split_response


def trl_dataset(env: TextParallelEnv, *, conversational: bool = False):
    """A ``datasets.Dataset`` with the combined ``prompt`` of every record and its ``index``."""
    import datasets

    rows = []
    for index in range(env.num_items):
        observations, _ = env.reset(options={"index": index})
        prompt = combine_observations(observations)
        rows.append(
            {
                "prompt": [{"role": "user", "content": prompt}] if conversational else prompt,
                "index": index,
            }
        )
    return datasets.Dataset.from_list(rows)


def _text(completion: Any) -> str:
    """TRL passes plain strings, or message lists for conversational datasets."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content", "") for message in completion)


class TRLRewardFunction:
    """``reward_funcs=[TRLRewardFunction(env)]``: each completion's joint reward (first turn)."""

    def __init__(self, env: TextParallelEnv, max_workers: int = 4):
        self.env = env
        self.roles = list(env.possible_agents)
        self.max_workers = max_workers
        self.__name__ = f"joint_reward_{type(env.task).__name__}"  # TRL logs rewards by name

    def score(self, completion: str, index: int) -> float:
        branch = copy.deepcopy(self.env)
        branch.reset(options={"index": int(index)})
        _, rewards, *_ = branch.step(split_response(completion, self.roles))
        return float(rewards[self.roles[0]])

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], index: Sequence[int], **_: Any
    ) -> list[float]:
        with ThreadPoolExecutor(self.max_workers) as pool:
            return list(pool.map(self.score, map(_text, completions), index))
