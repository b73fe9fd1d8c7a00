"""Text Dec-POMDPs for LLM collaboration, as PettingZoo parallel environments.

>>> import llm_marl_envs
>>> env = llm_marl_envs.make("coophumaneval-v2", data="coophumaneval.json", max_turns=2)
>>> observations, infos = env.reset(seed=0)
>>> observations, rewards, terminations, truncations, infos = env.step(
...     {"aux": "def aux(x):\\n    return x", "main": "def f(x):\\n    return aux(x)"})

Importing this package never imports torch, transformers or the trainer.
"""

from .env import TextParallelEnv
from .errors import (
    ConfigError,
    DataFormatError,
    DataUnavailableError,
    DeprecatedEnvError,
    LLMMarlEnvError,
    UnknownEnvError,
)
from .registry import EnvSpec, default_eval_split, make, register, registry, resolve_env_id
from .spaces import UnicodeText
from .task import Evaluation, Task

__all__ = [
    "ConfigError",
    "DataFormatError",
    "DataUnavailableError",
    "DeprecatedEnvError",
    "EnvSpec",
    "Evaluation",
    "LLMMarlEnvError",
    "Task",
    "TextParallelEnv",
    "UnicodeText",
    "UnknownEnvError",
    "default_eval_split",
    "make",
    "register",
    "registry",
    "resolve_env_id",
]
