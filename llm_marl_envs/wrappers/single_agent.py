"""A Gymnasium view of a suite environment: one agent acts for every role at once.

Observation: the combined prompt of all roles (see ``joint_text``); action: one text with a
section per role; reward: the joint reward. Multi-turn works as in the parallel env.
"""

from __future__ import annotations

from typing import Any

import gymnasium

from ..env import MAX_ACTION_CHARS, MAX_OBSERVATION_CHARS, TextParallelEnv
from ..registry import make
from ..spaces import TextObservation, UnicodeText
from .joint_text import combine_observations, split_response


class SingleAgentTextEnv(gymnasium.Env):
    metadata = {"render_modes": []}

    def __init__(self, env: TextParallelEnv):
        self.env = env
        self.roles = list(env.possible_agents)
        self.observation_space = UnicodeText(MAX_OBSERVATION_CHARS * len(self.roles))
        self.action_space = UnicodeText(MAX_ACTION_CHARS * len(self.roles))

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        observations, infos = self.env.reset(seed=seed, options=options)
        return TextObservation(combine_observations(observations)), infos[self.roles[0]]

    def step(self, action: str):
        parts = split_response(action, self.roles)
        observations, rewards, terminations, truncations, infos = self.env.step(parts)
        role = self.roles[0]
        done = terminations[role] or truncations[role]
        observation = "" if done else combine_observations(observations)
        info = {**infos[role], "actions": parts}
        return (
            TextObservation(observation),
            float(rewards[role]),
            terminations[role],
            truncations[role],
            info,
        )


def single_agent_env(env_id: str, **kwargs: Any) -> SingleAgentTextEnv:
    """``make(env_id, **kwargs)`` seen as a single-agent Gymnasium env."""
    return SingleAgentTextEnv(make(env_id, **kwargs))
