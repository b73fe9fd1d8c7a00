"""Play every environment of the suite with canned text agents and print the joint rewards.

    python examples/random_agents.py                       # data from the Hugging Face Hub
    python examples/random_agents.py --data tldr=tests/data/tldr_sample.jsonl \
        --data arxiv=tests/data/arxiv_sample.jsonl --data coophumaneval=path/to/coophumaneval.json

Each agent picks one of a few canned answers at random: no model needed. The point is the
loop, which is the same for any policy: reset, ask every agent for text, step, read rewards.
"""

from __future__ import annotations

import argparse
import random

import llm_marl_envs

CANNED = {
    "concise": [
        "The poster asks for advice about a problem.",
        "Someone describes a situation and wonders what to do next about it.",
    ],
    "detailed": [
        "The poster explains a difficult situation in detail. However, they are unsure "
        "what to do; for example, they list several options and, therefore, ask the "
        "community for advice before making a final decision about it."
    ],
    "background": ["Collaboration between models is an open problem. " * 20],
    "method": ["We propose a method and evaluate it carefully; moreover, results improve. " * 15],
    "aux": ["def aux(values):\n    return list(values)", "def aux(x):\n    return x"],
    "main": ["def solve(*args):\n    return aux(args[0])"],
}


def canned_action(agent: str, observation: str, rng: random.Random) -> str:
    text = rng.choice(CANNED[agent])
    if agent == "main":  # name the function the problem asks for
        entry_point = observation.split("Implement `", 1)[-1].split("`", 1)[0]
        text = text.replace("def solve", f"def {entry_point}")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="ENV=PATH",
        help="local data for an env, e.g. tldr=tests/data/tldr_sample.jsonl",
    )
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--max-turns", type=int, default=2)
    args = parser.parse_args()
    data = dict(item.split("=", 1) for item in args.data)
    rng = random.Random(0)

    for env_id in llm_marl_envs.registry():
        name = env_id.removesuffix("-v0")
        kwargs = (
            {"data": data[name], "split": "all" if "humaneval" in name else "train"}
            if name in data
            else {}
        )
        try:
            env = llm_marl_envs.make(env_id, max_turns=args.max_turns, **kwargs)
        except llm_marl_envs.LLMMarlEnvError as error:
            print(f"{env_id}: skipped. {error}\n")
            continue
        for episode in range(args.episodes):
            observations, _ = env.reset(seed=episode)
            returns = []
            while env.agents:
                actions = {
                    agent: canned_action(agent, observations[agent], rng) for agent in env.agents
                }
                observations, rewards, _, _, infos = env.step(actions)
                returns.append(rewards[env.possible_agents[0]])
                parts = infos[env.possible_agents[0]]["reward_parts"]
            print(
                f"{env_id} episode {episode} (item {env.item_index}): rewards per turn "
                f"{[round(r, 3) for r in returns]}, last parts "
                f"{ {k: round(v, 3) for k, v in parts.items()} }"
            )
        print()


if __name__ == "__main__":
    main()
