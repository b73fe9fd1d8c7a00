"""What the trainer needs from an environment, checked before training: the PettingZoo
parallel API with text spaces, the strings that end an answer and the tokens an answer may
take, and a horizon that agrees with the rollout's."""

from __future__ import annotations

import logging
from typing import Any

from gymnasium import spaces

from magrpo.config import is_positive_int

logger = logging.getLogger(__name__)


class IncompatibleEnvError(TypeError):
    """An environment that does not speak text (or lacks the ParallelEnv API)."""


def check_text_env(env: Any) -> list[str]:
    """Raise IncompatibleEnvError unless every agent observes and acts in text."""
    agents = list(getattr(env, "possible_agents", []) or [])
    if not agents or not hasattr(env, "step") or not hasattr(env, "reset"):
        raise IncompatibleEnvError(
            f"{type(env).__name__} is not a PettingZoo ParallelEnv with possible_agents, reset "
            "and step: MAGRPO needs the parallel API (wrap AEC envs with aec_to_parallel)."
        )
    for agent in agents:
        for kind in ("observation_space", "action_space"):
            space = getattr(env, kind)(agent)
            if not isinstance(space, spaces.Text):
                raise IncompatibleEnvError(
                    f"{type(env).__name__}.{kind}({agent!r}) is {space!r}, not a "
                    "gymnasium.spaces.Text: LLM agents read and write text, so MAGRPO only trains "
                    "on environments whose observations and actions are strings."
                )
    return agents


def _answer_formats(env: Any) -> dict[str, dict[str, Any]]:
    """``metadata["answer_format"]``: per agent, what the env declares about its answers
    (empty for an env that declares nothing)."""
    formats = (getattr(env, "metadata", None) or {}).get("answer_format") or {}
    return {agent: found for agent, found in formats.items() if isinstance(found, dict)}


def answer_stops(env: Any) -> dict[str, tuple[str, ...]]:
    """Per agent, the strings after which the env says an answer is complete
    (``metadata["answer_format"][agent]["stop"]``; none for an env that declares none)."""
    return {
        agent: tuple(str(s) for s in found.get("stop", ()) if s)
        for agent, found in _answer_formats(env).items()
    }


def answer_budget(env: Any) -> int:
    """The env's generation budget: the largest ``metadata["answer_format"][agent]
    ["max_tokens"]`` of its agents (one sampler serves them all). An env that declares none
    needs an explicit ``max_new_tokens``: no number fits every task."""
    budgets = [found.get("max_tokens") for found in _answer_formats(env).values()]
    budgets = [b for b in budgets if is_positive_int(b)]
    if not budgets:
        raise IncompatibleEnvError(
            f"{type(env).__name__} declares no answer budget (metadata['answer_format'][agent]"
            "['max_tokens']), so the trainer cannot choose a token limit for its answers: pass "
            "--max-new-tokens (max_new_tokens in the config)."
        )
    return max(budgets)


def check_horizon(env: Any, num_turns: int) -> None:
    """The rollout's horizon and the env's own (``max_turns``, when it declares one) agree.

    More rollout turns than the env allows would never be reached: an error. Fewer is legal
    (the tree stops early) but is likely a slip, so it is said.
    """
    max_turns = getattr(env, "max_turns", None)
    if not isinstance(max_turns, int) or max_turns == num_turns:
        return
    if num_turns > max_turns:
        raise IncompatibleEnvError(
            f"num_turns={num_turns}, but the env ends every episode after {max_turns} turn(s): "
            f"the extra turns would never be reached. Pass --num-turns {max_turns}, or make the "
            f"env with max_turns={num_turns} (--env-kwargs '{{\"max_turns\": {num_turns}}}')."
        )
    logger.warning(
        "num_turns=%d but the env allows %d turns: rollouts stop after %d turn(s), and the "
        "env's later turns are never trained.", num_turns, max_turns, num_turns,
    )


def check_state(env: Any, algorithm: str) -> None:
    """An algorithm with a centralised critic needs PettingZoo's ``state()``."""
    if not callable(getattr(env, "state", None)) or getattr(env, "state_space", None) is None:
        raise IncompatibleEnvError(
            f"--algorithm {algorithm} reads the env's global state, but {type(env).__name__} "
            "has no state() and state_space (PettingZoo's centralised-training API): implement "
            "them, or choose an algorithm without a centralised critic (magrpo, iac)."
        )
