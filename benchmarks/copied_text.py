"""How much of each held-out answer is copied word for word from the agent's own prompt?

    python benchmarks/copied_text.py benchmarks/results/learning_tldr_180.json \\
        --data examples/data/tldr_synthetic

The writing rewards (docs/reference.md §3) compare the two agents' texts with each other and
never with the source: a long, varied "detailed summary" earns the length and vocabulary
levels whether it summarises the post or repeats it. This reads the answers that
``learning.py`` stored, rebuilds each agent's prompt from the env (reset on the same problem)
and reports, per checkpoint and agent, the share of the answer's runs of six words that also
occur in that prompt, and the joint reward that the newest version of the env, whose first
level fails a copy (``max_copied_share``), gives the same answers. Each is the mean over
problems of the per-problem mean, ± its standard error over problems, as ``learning.py``
reports.

A share near 0 is an answer in the agent's own words; near 1, a copy of the prompt. Six words
in a row are rarely shared by chance: untrained TLDR summaries reach 0.1-0.15.

It also reports a second way to fill a text without summarising: instruction lines, bullets
that open with an imperative verb like the prompts' own ("- Provide a brief and focused
summary", "- Offer a few specific examples"). They lengthen a text towards the length level's
band without saying anything about the post. Per checkpoint: the share of each agent's answers
with such a line, and the newest env's joint reward once those lines are removed.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

from learning import summarise

import llm_marl_envs
from llm_marl_envs.rewards.text import COPY_RUN_WORDS, copied_share

INSTRUCTION_LINE = re.compile(
    r"\s*[-*•]\s*(provide|be|use|offer|add|specify|include|keep|focus|make|write|avoid|give)\b",
    re.IGNORECASE,
)


def instruction_lines(text: str) -> list[str]:
    """The lines of ``text`` that are bullets opening with an imperative verb."""
    return [line for line in text.splitlines() if INSTRUCTION_LINE.match(line)]


def without_instruction_lines(text: str) -> str:
    """``text`` without its instruction lines; unchanged, whitespace included, if it has none."""
    lines = text.splitlines()
    kept = [line for line in lines if not INSTRUCTION_LINE.match(line)]
    return text if len(kept) == len(lines) else "\n".join(kept).strip()


def newest_env(results: dict, data: str | None):
    """The newest version of the results' env, on the split the results were evaluated on.
    The writing envs' prompts are the same in v1 and v2, which differ in their reward."""
    name = results["env"].rsplit("-v", 1)[0]
    return llm_marl_envs.make(name, data=data, split=results["eval_split"])


def copied_by_step(results: dict, env) -> dict[str, dict]:
    """Per checkpoint: for each agent, the share of its answers' six-word runs found in its
    prompt; and the joint reward the newest env gives the same answers. Each is the mean ±
    SE over problems of the per-problem mean, with its paired change from the first step.
    Also each agent's share of answers with an instruction line, and the joint reward of the
    same answers without those lines."""
    name = env.metadata["name"]
    report = {}
    for step, rows in results["answers"].items():
        per_problem: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for row in rows:
            observations, _ = env.reset(options={"index": row["problem"]})
            for agent, text in row["texts"].items():
                share = copied_share(text, observations[agent])
                per_problem[agent][row["problem"]].append(share)
                has_instructions = float(bool(instruction_lines(text)))
                per_problem[f"instruction lines, {agent}"][row["problem"]].append(has_instructions)
            joint = joint_reward(env, row["problem"], row["texts"])
            stripped = {agent: without_instruction_lines(t) for agent, t in row["texts"].items()}
            if stripped != row["texts"]:
                joint_stripped = joint_reward(env, row["problem"], stripped)
            else:
                joint_stripped = joint
            per_problem[f"joint reward, {name}"][row["problem"]].append(joint)
            per_problem[f"{name} without instruction lines"][row["problem"]].append(joint_stripped)
        report[step] = {
            column: [sum(v) / len(v) for v in by_problem.values()]
            for column, by_problem in per_problem.items()
        }
    return summarise(report)


def joint_reward(env, problem: int, texts: dict[str, str]) -> float:
    env.reset(options={"index": problem})
    _, rewards, _, _, _ = env.step(texts)
    return sum(rewards.values()) / len(rewards)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a results JSON written by learning.py")
    p.add_argument("--data", default=None, help="the data the run was evaluated on")
    args = p.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    report = copied_by_step(results, newest_env(results, args.data))
    columns = list(next(iter(report.values())))
    print(
        f"{results['env']} answers: the share of each agent's {COPY_RUN_WORDS}-word runs "
        "copied from its prompt, the share of its answers with instruction lines, and the "
        "newest env's joint reward with and without those lines; in brackets the paired "
        "change from the first step"
    )
    print("| step | " + " | ".join(columns) + " |")
    print("| ---: |" + " ---: |" * len(columns))
    for step, row in report.items():
        cells = [
            f"{row[c]['value']:.2f} ± {row[c]['se']:.2f} "
            f"({row[c]['change']['value']:+.2f} ± {row[c]['change']['se']:.2f})"
            for c in columns
        ]
        print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
