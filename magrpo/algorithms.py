"""Algorithms: what a training step computes between the rollout and the optimizer steps.

The trainer owns everything around an algorithm: the rollout (sampling, joint actions,
returns), the policies and their optimizers, micro-batching, checkpoints, logging and the
speed-ups. An :class:`Algorithm` decides the rest:

- :meth:`~Algorithm.advantages`: one advantage per sampled completion, from the rollout
  (returns, values, baselines);
- :meth:`~Algorithm.token_loss`: the per-token policy loss (the loss *reduction* is still
  chosen by ``loss_type``);
- :meth:`~Algorithm.update_extras`: train the algorithm's own parts (a critic), after the
  policies' step;
- :meth:`~Algorithm.state_dict` / :meth:`~Algorithm.load_state_dict` / :meth:`~Algorithm.save`:
  checkpoint and export those parts.

Register a subclass with ``@register_algorithm("name")`` and train with
``--algorithm name``; ``examples/third_party_algorithm.py`` does it from outside the package.
MAGRPO itself is the class below; the actor-critic algorithms are in ``magrpo.actor_critic``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from magrpo.advantages import compute_advantages
from magrpo.losses import policy_token_loss
from magrpo.rollout import Completion, RolloutResult


@dataclass
class TrainSample:
    """One completion with its advantage, ready for the loss."""

    completion: Completion
    advantage: float

    @property
    def agent(self) -> str:
        return self.completion.agent


class Algorithm:
    """The do-nothing-extra base: the paper's policy loss on advantages a subclass computes.

    ``config`` is the run's ``MAGRPOConfig``, ``policies`` the agents' ``Policies`` (for
    features or log-probs of one's own), ``parallel`` the ``DataParallel`` of the run (sum
    values and gradients over processes; one process: a no-op).
    """

    #: Advantages come from ``--advantage`` (a group baseline), so ``group_size`` must give
    #: groups. Algorithms with their own baseline (a critic) set this to False.
    uses_advantage_setting = False
    #: The rollout records every node's ``env.state()`` (for centralised critics).
    reads_state = False

    def __init__(self, config: Any, policies: Any, parallel: Any):
        self.config = config
        self.policies = policies
        self.parallel = parallel

    def advantages(self, rollout: RolloutResult) -> tuple[list[TrainSample], dict[str, float]]:
        """Every completion of the rollout with its advantage, and metrics to log."""
        raise NotImplementedError

    def token_loss(
        self,
        logprobs: torch.Tensor,
        advantages: torch.Tensor,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token loss [B, T] (and per-token KL, or None) of a micro-batch.

        Default: -A * log pi, or PPO's clipped surrogate with ``clip_epsilon``, plus the KL
        penalty with ``kl_coef`` (``magrpo.losses.policy_token_loss``)."""
        config = self.config
        return policy_token_loss(
            logprobs,
            advantages,
            old_logprobs if config.clip_epsilon is not None else None,
            config.clip_epsilon,
            ref_logprobs,
            config.kl_coef,
        )

    def update_extras(self, rollout: RolloutResult) -> dict[str, float]:
        """Train the algorithm's own parts on the rollout, after the policies' step."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the algorithm (its parts and their optimizers)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` when a run resumes."""

    def save(self, directory: Path) -> None:
        """Export the trained parts next to the final adapters or models."""


_ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(name: str) -> Callable[[type[Algorithm]], type[Algorithm]]:
    """Class decorator: make an :class:`Algorithm` subclass available as ``--algorithm name``."""

    def decorate(cls: type[Algorithm]) -> type[Algorithm]:
        if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
            raise TypeError(f"register_algorithm({name!r}) needs a subclass of Algorithm")
        _ALGORITHMS[name] = cls
        return cls

    return decorate


def available_algorithms() -> list[str]:
    return sorted(_ALGORITHMS)


def get_algorithm(name: str) -> type[Algorithm]:
    if name not in available_algorithms():
        raise KeyError(
            f"Unknown algorithm {name!r}; registered: {', '.join(available_algorithms())}."
        )
    return _ALGORITHMS[name]


@register_algorithm("magrpo")
class MAGRPO(Algorithm):
    """MAGRPO: each node's G samples of an agent form a group, and each sample's advantage
    is its return against the group's baseline (``--advantage``; the paper's: the mean)."""

    uses_advantage_setting = True

    def advantages(self, rollout: RolloutResult) -> tuple[list[TrainSample], dict[str, float]]:
        samples: list[TrainSample] = []
        groups = zero_variance = 0
        for node in rollout.nodes:
            for agent in node.agents:
                returns = torch.tensor(node.sample_returns[agent], dtype=torch.float64)
                advantages = compute_advantages(
                    returns, self.config.advantage, self.config.normalize_advantage_std
                )
                groups += 1
                zero_variance += int(bool((returns == returns[0]).all()))
                samples.extend(
                    TrainSample(c, float(a))
                    for c, a in zip(node.samples[agent], advantages.tolist(), strict=True)
                )
        zero_variance, groups = self.parallel.sum([zero_variance, groups])
        return samples, {"zero_variance_group_frac": zero_variance / max(groups, 1)}
