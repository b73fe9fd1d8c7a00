"""One PettingZoo ``ParallelEnv`` for every text task.

The environment implements the protocol (reset, step, seeding, turns, termination) and
delegates the domain to a :class:`~llm_marl_envs.task.Task`. Observations and actions are
Python strings; every agent receives the same joint reward, with its named breakdown in
``infos[agent]["reward_parts"]``. ``metadata["answer_format"]`` says, per agent, where an
answer ends and how long it should be allowed to get.

Centralised training: ``state()`` is a text with what a centralised critic may see and no
agent does: every agent's observations and actions so far and each turn's result.
Observations are unchanged by it, so execution stays decentralised.

Branching: ``copy.deepcopy(env)`` copies only the episode state (a few strings and an RNG);
the task and its dataset are shared. Trainers use it to score G joint actions of one node.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from gymnasium.utils import seeding
from pettingzoo import ParallelEnv

from .errors import ConfigError
from .spaces import TextObservation, UnicodeText
from .task import Evaluation, Task

MAX_OBSERVATION_CHARS = 1 << 20
MAX_ACTION_CHARS = 1 << 16
MAX_STATE_CHARS = 1 << 24


class TextParallelEnv(ParallelEnv):
    """A multi-turn Dec-POMDP over a dataset of prompts, scored by one joint reward."""

    metadata = {
        "render_modes": ["human", "ansi"],
        "name": "text_parallel_v0",
        "is_parallelizable": True,
    }

    def __init__(self, task: Task, *, max_turns: int = 1, render_mode: str | None = None):
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ConfigError(f"max_turns must be a positive integer, got {max_turns!r}.")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ConfigError(
                f"render_mode must be one of {self.metadata['render_modes']} or None, "
                f"got {render_mode!r}."
            )
        self.task = task
        self.max_turns = max_turns
        self.metadata = {**self.metadata, "answer_format": answer_format(task)}
        self.render_mode = render_mode
        self.possible_agents = list(task.roles)
        self.state_space = UnicodeText(MAX_STATE_CHARS)
        self.agents: list[str] = []
        self.np_random, self.np_random_seed = seeding.np_random(None)
        self.item_index: int | None = None
        self.turn = 0
        self._last_actions: dict[str, str] = {}
        self._last_evaluation: Evaluation | None = None
        self._history: list[str] = []  # the sections of state()

    @property
    def num_items(self) -> int:
        """How many dataset records (episode starts) there are; ``options["index"]`` < this."""
        return len(self.task.records)

    @functools.cache  # noqa: B019 - spaces are constant per agent, as in PettingZoo's own envs
    def observation_space(self, agent: str) -> UnicodeText:
        return UnicodeText(MAX_OBSERVATION_CHARS)

    @functools.cache  # noqa: B019
    def action_space(self, agent: str) -> UnicodeText:
        return UnicodeText(MAX_ACTION_CHARS)

    def reset(
        self, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, str], dict[str, dict]]:
        if seed is not None:
            self.np_random, self.np_random_seed = seeding.np_random(seed)
        index = (options or {}).get("index")
        if index is None:
            index = int(self.np_random.integers(self.num_items))
        elif not isinstance(index, int) or not 0 <= index < self.num_items:
            raise ConfigError(
                f"options['index'] must be an integer in [0, {self.num_items}), got {index!r}."
            )
        self.item_index = index
        self.turn = 0
        self.agents = list(self.possible_agents)
        self._last_actions = {}
        self._last_evaluation = None
        infos = {agent: {"index": index, "turn": 0} for agent in self.agents}
        observations = self.task.prompts(self.item)
        self._history = [_section("turn 1: observations", observations)]
        return _as_observations(observations), infos

    @property
    def item(self) -> Mapping[str, Any]:
        if self.item_index is None:
            raise RuntimeError("Call reset() before using the environment.")
        return self.task.records[self.item_index]

    def step(self, actions: Mapping[str, str]):
        if not self.agents:
            raise RuntimeError("The episode is over: call reset() before step().")
        missing = [agent for agent in self.agents if agent not in actions]
        if missing:
            raise ValueError(f"step() needs an action for every agent; missing {missing}.")
        joint_action = {agent: str(actions[agent]) for agent in self.agents}
        evaluation = self.task.evaluate(self.item, joint_action)
        self.turn += 1
        self._last_actions = joint_action
        self._last_evaluation = evaluation

        reward = evaluation.joint_reward
        terminated = evaluation.solved
        truncated = not terminated and self.turn >= self.max_turns
        if terminated or truncated:
            observations = _as_observations({agent: "" for agent in self.agents})
        else:
            observations = _as_observations(
                self.task.followups(self.item, joint_action, evaluation)
            )
        parts = ", ".join(f"{k} {v:.3f}" for k, v in evaluation.reward_parts.items())
        ending = " (solved)" if terminated else " (last turn)" if truncated else ""
        self._history += [
            _section(f"turn {self.turn}: actions", joint_action),
            f"## turn {self.turn}: joint reward {reward:.3f}{ending}\n{parts}",
        ]
        if not (terminated or truncated):
            self._history.append(_section(f"turn {self.turn + 1}: observations", observations))
        info = {
            "index": self.item_index,
            "turn": self.turn,
            "reward_parts": dict(evaluation.reward_parts),
            **evaluation.details,
        }
        agents = self.agents
        rewards = {agent: reward for agent in agents}
        terminations = {agent: terminated for agent in agents}
        truncations = {agent: truncated for agent in agents}
        infos = {agent: dict(info) for agent in agents}
        if terminated or truncated:
            self.agents = []
        if self.render_mode == "human":
            print(self.render())
        return observations, rewards, terminations, truncations, infos

    def state(self) -> str:
        """The global state for centralised training (a text in ``state_space``): every
        agent's observation and action of every turn so far, and each turn's joint reward
        and its parts. No agent observes it."""
        if not self._history:
            raise RuntimeError("Call reset() before state().")
        return TextObservation("\n\n".join(self._history))

    def render(self) -> str | None:
        if self.render_mode is None:
            return None
        lines = [f"[{type(self.task).__name__} item {self.item_index}, turn {self.turn}]"]
        for agent, text in self._last_actions.items():
            lines.append(f"--- {agent} ---\n{text}")
        if self._last_evaluation is not None:
            lines.append(
                f"joint reward {self._last_evaluation.joint_reward:.3f} "
                f"{dict(self._last_evaluation.reward_parts)}"
            )
        return "\n".join(lines)

    def close(self) -> None:
        pass


def answer_format(task: Task) -> dict[str, dict[str, Any]]:
    """What a trainer needs to generate each agent's answer well, without knowing the task:
    ``stop`` (strings after which the answer is complete; the sampler may stop there and
    keep them) and ``max_tokens`` (a generation budget within which answers to the task end)."""
    return {
        role: {
            "stop": list(task.stop_sequences.get(role, ())),
            "max_tokens": task.suggested_max_tokens,
        }
        for role in task.roles
    }


def _section(title: str, texts: Mapping[str, str]) -> str:
    return f"## {title}\n" + "\n".join(f"### {agent}\n{text}" for agent, text in texts.items())


def _as_observations(texts: Mapping[str, str]) -> dict[str, TextObservation]:
    return {agent: TextObservation(text) for agent, text in texts.items()}
