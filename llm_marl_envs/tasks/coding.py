"""Cooperative coding: a helper writes ``aux``, the main agent writes the entry-point function.

Both agents are told the same contract: ``aux`` takes the same arguments as the entry point
and returns a value that helps compute its answer. Neither sees the other's code: the main
agent may call ``aux(...)`` without seeing it, and the helper writes it without seeing the
main function (the paper's decentralised execution). The helper sees the problem as text
(signature and docstring), not as a ``def`` stub to complete, and its instruction ends in the
skeleton of ``aux``: a small model given the stub completes the stub instead. The main agent
keeps the stub (it *should* complete that function), and its instruction ends in the stub
followed by ``result = aux(<the entry point's arguments>)``: told only that it *may* call
``aux``, the untrained default model called it in 2% of its answers.

The helper's code and main's code run in separate sandbox workers (``rewards/coding.py``).
Multi-turn: each agent sees its own previous code and the test diagnostics; a fully passing
program ends the episode.

Named splits follow the paper: HumanEval train 33-132 and eval 133-163; CoopHumanEval train
0-49, eval 50-65, test 66-81; ``all`` is every problem.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..data import Records
from ..errors import ConfigError, DataFormatError
from ..rewards.code_analysis import problem_context
from ..rewards.coding import (
    FEEDBACK_FAILURES,
    HELPER_NAME,
    MAX_CODING_REWARD,
    coding_feedback,
    score_coding,
)
from ..sandbox.checks import parse_python
from ..task import Evaluation, Task

CONTRACT = (
    "`{helper}({call})` takes the same arguments as `{entry_point}` and returns a value that "
    "helps compute the answer, such as an intermediate result or a check."
)
AUX_INSTRUCTIONS = (
    "You are the helper in a team of two Python programmers. Your teammate solves the "
    "problem below; you write a helper function named `{helper}` that your teammate will "
    "call.\n\n"
    "The problem:\n{context}{docstring}\n\n"
    "The contract: {contract} Your teammate calls `{helper}({call})` without seeing your "
    "code.\n\n"
    "Answer with only the code of `{helper}` (and any imports it needs), no explanation, "
    "by completing this skeleton:\n"
    "```python\ndef {helper}({parameters}):\n    ...\n    return result\n```"
)
MAIN_INSTRUCTIONS = (
    "You are the main programmer in a team of two. Complete the function `{entry_point}` "
    "below. Your teammate writes a helper function: {contract} You cannot see its code, and "
    "you do not define `{helper}` yourself. Call `{helper}({call})` inside `{entry_point}` "
    "and use its result to compute the answer. Write only the code of `{entry_point}` as one "
    "Python code block.\n\n{skeleton}"
)
#: What main's skeleton adds below the problem's stub, at the indentation of its body.
MAIN_SKELETON_BODY = ("result = {helper}({call})", "...", "return answer")


@dataclass(frozen=True)
class ProblemText:
    """A problem's entry point described as text, for an agent that must not complete it."""

    signature: str  # "(n: int, x, y) -> int"
    parameters: str  # "n: int, x, y": the parameter list, as written
    call: str  # "n, x, y": how to call a function of the same signature
    docstring: str
    context: str  # imports and definitions the problem provides besides the entry point
    indent: str  # the indentation of the entry point's body in the prompt


def problem_text(prompt: str, entry_point: str) -> ProblemText:
    """Split a HumanEval-style prompt into the entry point's signature, docstring and context."""
    try:
        tree = parse_python(prompt)
    except SyntaxError as error:
        raise DataFormatError(
            f"The prompt of the problem with entry point {entry_point!r} is not valid Python "
            f"({error}); the coding tasks need HumanEval-style prompts (a def with a docstring)."
        ) from None
    function = next(
        (
            node
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name == entry_point
        ),
        None,
    )
    if function is None:
        raise DataFormatError(
            f"The problem prompt does not define its entry point {entry_point!r}; the coding "
            "tasks need HumanEval-style prompts (the def of entry_point with a docstring)."
        )
    strings = [
        node.value.value
        for node in function.body
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    returns = f" -> {ast.unparse(function.returns)}" if function.returns else ""
    parameters = ast.unparse(function.args)
    return ProblemText(
        signature=f"({parameters}){returns}",
        parameters=parameters,
        call=_call_arguments(function.args),
        docstring=inspect.cleandoc(strings[0]) if strings else "",
        context=problem_context(prompt, entry_point),
        indent=" " * (function.body[0].col_offset),
    )


def main_skeleton(prompt: str, text: ProblemText) -> str:
    """The problem's stub followed by a call of ``aux`` whose result the body goes on from."""
    fields = {"helper": HELPER_NAME, "call": text.call}
    body = "\n".join(text.indent + line.format(**fields) for line in MAIN_SKELETON_BODY)
    return f"{prompt.strip()}\n{body}"


def _call_arguments(args: ast.arguments) -> str:
    """``a, b, *rest, key=key, **options``: the call that passes every parameter along."""
    names = [arg.arg for arg in [*args.posonlyargs, *args.args]]
    if args.vararg:
        names.append(f"*{args.vararg.arg}")
    names += [f"{arg.arg}={arg.arg}" for arg in args.kwonlyargs]
    if args.kwarg:
        names.append(f"**{args.kwarg.arg}")
    return ", ".join(names)


class CodingTask(Task):
    roles = ("aux", "main")
    max_reward = MAX_CODING_REWARD
    #: An answer is complete at the closing fence of its code block (not at the opening
    #: one: "```python" does not match).
    stop_sequences = {"aux": ("\n```\n",), "main": ("\n```\n",)}
    #: 91% of SmolLM2-135M-Instruct's answers end within 384 tokens, 86.5% within the
    #: paper's 256; most of the rest loop (docs/training.md, "The token limit").
    suggested_max_tokens = 384
    paper_splits: Mapping[str, range] = {}

    def __init__(
        self,
        records: Records,
        *,
        sandbox_settings=None,
        feedback_failures: int = FEEDBACK_FAILURES,
    ):
        super().__init__(records)
        if not isinstance(feedback_failures, int) or isinstance(feedback_failures, bool) or (
            feedback_failures < 0
        ):
            raise ConfigError(
                "feedback_failures (failing asserts shown verbatim at the next turn) must be an "
                f"integer >= 0, got {feedback_failures!r}."
            )
        self.sandbox_settings = sandbox_settings
        self.feedback_failures = feedback_failures
        for item in records:  # a malformed problem fails here, not in the middle of training
            problem_text(item["prompt"], item["entry_point"])

    def prompts(self, item: Mapping[str, Any]) -> dict[str, str]:
        entry_point = item["entry_point"]
        text = problem_text(item["prompt"], entry_point)
        fields = {"helper": HELPER_NAME, "entry_point": entry_point, "call": text.call}
        contract = CONTRACT.format(**fields)
        context = f"```python\n{text.context}\n```\n" if text.context.strip() else ""
        return {
            "aux": AUX_INSTRUCTIONS.format(
                **fields,
                contract=contract,
                parameters=text.parameters,
                docstring=text.docstring,
                context=context,
            ),
            "main": MAIN_INSTRUCTIONS.format(
                **fields, contract=contract, skeleton=main_skeleton(item["prompt"], text)
            ),
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
            feedback=coding_feedback(score, item["entry_point"], self.feedback_failures),
            solved=details["tests_total"] > 0 and details["tests_passed"] == details["tests_total"],
        )


class HumanEvalTask(CodingTask):
    paper_splits = {"train": range(33, 133), "eval": range(133, 164)}


class CoopHumanEvalTask(CodingTask):
    paper_splits = {"train": range(0, 50), "eval": range(50, 66), "test": range(66, 82)}
