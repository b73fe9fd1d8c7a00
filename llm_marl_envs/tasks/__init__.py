"""The four tasks of the suite. Each is a :class:`~llm_marl_envs.task.Task` subclass."""

from .coding import CoopHumanEvalTask, HumanEvalTask
from .writing import ArxivTask, TldrTask

__all__ = ["ArxivTask", "CoopHumanEvalTask", "HumanEvalTask", "TldrTask"]
