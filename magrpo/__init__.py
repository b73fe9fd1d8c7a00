"""MAGRPO: multi-agent group-relative policy optimisation for LLM agents on text envs.

Quick start::

    from magrpo import MAGRPOConfig, MAGRPOTrainer
    trainer = MAGRPOTrainer(MAGRPOConfig(max_steps=10), env)   # any text ParallelEnv
    result = trainer.train()

or ``python -m magrpo.train --env coophumaneval``. New algorithms plug in by name with
``register_algorithm`` (an ``Algorithm`` subclass: advantages, loss, own parts such as a
critic) or, for smaller changes, ``register_advantage`` / ``register_loss``.
"""

from magrpo.actor_critic import IAC, MAAC  # registers iac and maac beside magrpo
from magrpo.advantages import available_advantages, compute_advantages, register_advantage
from magrpo.algorithms import Algorithm, available_algorithms, register_algorithm
from magrpo.config import ConfigError, MAGRPOConfig
from magrpo.losses import LossNormalizer, available_losses, register_loss
from magrpo.rollout import Completion, JointOutcome, Node, RolloutResult, run_rollout
from magrpo.trainer import MAGRPOTrainer, TrainResult, TrainSample

__all__ = [
    "Algorithm",
    "Completion",
    "IAC",
    "ConfigError",
    "JointOutcome",
    "LossNormalizer",
    "MAAC",
    "MAGRPOConfig",
    "MAGRPOTrainer",
    "Node",
    "RolloutResult",
    "TrainResult",
    "TrainSample",
    "available_advantages",
    "available_algorithms",
    "available_losses",
    "compute_advantages",
    "register_advantage",
    "register_algorithm",
    "register_loss",
    "run_rollout",
]
