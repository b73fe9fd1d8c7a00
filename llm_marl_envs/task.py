"""The domain half of an environment: what each agent is asked, how the joint action is scored.

A :class:`Task` is stateless. The environment (``env.py``) owns the episode (which record,
which turn, who is still acting) and asks the task three questions: what does each agent see
first (:meth:`Task.prompts`), what is this joint action worth (:meth:`Task.evaluate`), and
what does each agent see next (:meth:`Task.followups`). A new task is a subclass and a line in
the registry; the PettingZoo protocol is written once.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .data import Records


@dataclass(frozen=True)
class Evaluation:
    """The score of one joint action.

    ``reward_parts`` are named components that sum to the joint reward (so a trainer can log
    what was learnt, not only how much). ``details`` are deterministic diagnostics copied into
    every agent's ``infos``. ``feedback`` is the text the task shows at the next turn.
    """

    reward_parts: Mapping[str, float]
    details: Mapping[str, Any] = field(default_factory=dict)
    feedback: str = ""
    solved: bool = False

    @property
    def joint_reward(self) -> float:
        return math.fsum(self.reward_parts.values())


class Task(abc.ABC):
    """A cooperative text task for a fixed set of roles (the agent names)."""

    #: Agent names, in the order a trainer should list them.
    roles: Sequence[str] = ()
    #: Upper bound of the joint reward of one turn.
    max_reward: float = 0.0
    #: Per role: text after which an answer is complete (a sampler may stop there).
    stop_sequences: Mapping[str, Sequence[str]] = {}
    #: A generation budget, in tokens of a typical subword tokenizer, within which answers to
    #: the task end: room for a good answer and the prose models write around it.
    suggested_max_tokens: int = 256

    def __init__(self, records: Records):
        self.records = records

    def __deepcopy__(self, memo: dict) -> Task:
        return self  # stateless and immutable: every env branch shares it

    @abc.abstractmethod
    def prompts(self, item: Mapping[str, Any]) -> dict[str, str]:
        """Each role's first observation for a dataset record."""

    @abc.abstractmethod
    def evaluate(self, item: Mapping[str, Any], actions: Mapping[str, str]) -> Evaluation:
        """Score one joint action (one text per role)."""

    def followups(
        self,
        item: Mapping[str, Any],
        actions: Mapping[str, str],
        evaluation: Evaluation,
    ) -> dict[str, str]:
        """Next-turn observations: the first prompt, the role's own answer, shared feedback.

        Each agent sees only its own previous answer (the Dec-POMDP's partial observability),
        plus the feedback the environment gives both.
        """
        first = self.prompts(item)
        return {
            role: (
                f"{first[role]}\n\n"
                f"Your previous answer:\n{actions[role]}\n\n"
                f"Feedback on the team's previous attempt:\n{evaluation.feedback}\n\n"
                "Revise your answer."
            )
            for role in self.roles
        }
