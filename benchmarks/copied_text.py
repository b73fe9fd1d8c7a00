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
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from learning import summarise

import llm_marl_envs
from llm_marl_envs.rewards.text import COPY_RUN_WORDS, copied_share


def newest_env(results: dict, data: str | None):
    """The newest version of the results' env, on the split the results were evaluated on.
    The writing envs' prompts are the same in v1 and v2, which differ in their reward."""
    name = results["env"].rsplit("-v", 1)[0]
    return llm_marl_envs.make(name, data=data, split=results["eval_split"])


def copied_by_step(results: dict, env) -> dict[str, dict]:
    """Per checkpoint: for each agent, the share of its answers' six-word runs found in its
    prompt; and the joint reward the newest env gives the same answers. Each is the mean ±
    SE over problems of the per-problem mean, with its paired change from the first step."""
    report = {}
    for step, rows in results["answers"].items():
        per_problem: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for row in rows:
            observations, _ = env.reset(options={"index": row["problem"]})
            for agent, text in row["texts"].items():
                share = copied_share(text, observations[agent])
                per_problem[agent][row["problem"]].append(share)
            _, rewards, _, _, _ = env.step(row["texts"])
            joint = sum(rewards.values()) / len(rewards)
            per_problem[f"joint reward, {env.metadata['name']}"][row["problem"]].append(joint)
        report[step] = {
            column: [sum(v) / len(v) for v in by_problem.values()]
            for column, by_problem in per_problem.items()
        }
    return summarise(report)


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
        "copied from its prompt, and the newest env's joint reward; in brackets the paired "
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
