"""Views of the suite for single-agent stacks: one policy writes every role's part in one text.

- :func:`single_agent_env`: a Gymnasium ``Env`` over any env of the suite.
- :class:`TRLRewardFunction` and :func:`trl_dataset`: any env as a ``reward_funcs`` entry and a
  prompt dataset for ``trl.GRPOTrainer`` (the paper's single-model baseline trained with GRPO).
"""

from .joint_text import combine_observations, split_response
from .single_agent import SingleAgentTextEnv, single_agent_env
from .trl import TRLRewardFunction, trl_dataset

__all__ = [
    "SingleAgentTextEnv",
    "TRLRewardFunction",
    "combine_observations",
    "single_agent_env",
    "split_response",
    "trl_dataset",
]
