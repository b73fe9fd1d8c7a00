"""What the untrained default model writes in a coding env, as the reward's static analysis sees it.

    cd /work/main && git worktree add /work/wt-before 137b970   # the code measured "before"
    PYTHONPATH=/work/wt-before .venv/bin/python benchmarks/untrained_coding_answers.py \\
        --data ../shared/data/coophumaneval/coophumaneval.json --label before \\
        --out benchmarks/results/untrained_coding_answers_before.json
    # the same with --max-new-tokens 256 --label before-256; "after": without PYTHONPATH
    # (the working tree's code), --label after; --limit 2 for a quick look

Each run writes its exact command, the git commit of the imported code and every answer.

For every problem of ``--split`` (CoopHumanEval ``train``: problems 0-49) the env is reset
with ``options={"index": i}`` and each agent's first observation is sampled ``--samples``
times, the way the trainer does it: ``magrpo.policies.load_policies`` with the defaults of
``MAGRPOConfig`` (SmolLM2-135M-Instruct from ``resolve_model``, one fresh LoRA adapter per
agent, i.e. the base model; chat template on; temperature, top_p, top_k, max_new_tokens) and
``Policies.sample`` with one seed per (problem, agent), so a sample does not depend on the
batch it shares. Each answer goes through ``extract_definitions`` / ``returns_value`` /
``aux_usage`` exactly as ``llm_marl_envs.rewards.coding`` calls them, giving the shares of
helper answers that define ``aux`` (at all, and with a return value), of main answers that
define the entry point with a return and that call ``aux``, and of answers cut off at
``max_new_tokens`` (no EOS). Sample g of ``aux`` and sample g of ``main`` form a joint action
that ``env.step`` scores (tests in the sandbox): mean joint reward and mean reward parts.
Shares come with the binomial SE sqrt(p(1-p)/n), means with std/sqrt(n); the samples of one
problem are not independent, so both SEs are somewhat optimistic. The code measured is the
``llm_marl_envs``/``magrpo`` that Python imports (PYTHONPATH first): its git commit is recorded.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch

import llm_marl_envs
import magrpo
from llm_marl_envs.rewards.code_analysis import aux_usage, extract_definitions, returns_value
from llm_marl_envs.rewards.coding import HELPER_NAME
from magrpo.config import MAGRPOConfig
from magrpo.loading import load_policies
from magrpo.models import DEFAULT_MODEL, resolve_model
from magrpo.policies import SamplingParams
from magrpo.rollout import derive_seed

REPO = Path(__file__).resolve().parent.parent
DEFAULTS = MAGRPOConfig()
# the trainer's load_policies arguments (magrpo.trainer.Trainer._load_policies), at their defaults
LOAD_FIELDS = ("finetune", "lora_rank", "lora_alpha", "lora_target_modules", "dtype")
LOAD_OPTIONS = {name: getattr(DEFAULTS, name) for name in (*LOAD_FIELDS, "use_chat_template")}
PROBLEMS_PER_CALL = 8  # one Policies.sample call: 8 problems x 2 agents x G rows


def analyse(agent: str, text: str, entry_point: str) -> dict[str, bool]:
    """The reward's static facts about one answer (as ``score_coding``/``assemble`` get them)."""
    if agent == HELPER_NAME:
        aux = extract_definitions(text, HELPER_NAME, exclude=frozenset({entry_point}))
        return {"defines_aux": aux.target_source != "", "aux_returns": returns_value(aux)}
    main = extract_definitions(text, entry_point, exclude=frozenset({HELPER_NAME}))
    return {
        "main_returns": returns_value(main),
        "calls_aux": aux_usage(main.target, HELPER_NAME).calls_aux,
    }


def test_outcomes(info: dict) -> dict[str, bool]:
    """Whether a joint answer passed every assert, and whether the helper's ``aux`` ran during
    a passing assert (the cooperation bonus was paid), from the env's ``infos``."""
    total = info.get("tests_total", 0)
    return {
        "all asserts pass": bool(total) and info.get("tests_passed", 0) == total,
        "cooperation bonus paid": info.get("aux_ran_in_passing_tests", 0) > 0,
    }


def share(flags: list[bool]) -> dict[str, float]:
    n = len(flags)
    p = sum(flags) / n
    return {"value": p, "se": math.sqrt(p * (1 - p) / n), "n": n}


def mean(values: list[float]) -> dict[str, float]:
    n = len(values)
    m = sum(values) / n
    var = sum((v - m) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return {"value": m, "se": math.sqrt(var / n), "n": n}


def sample_problems(policies, env, indices, params, samples: int, seed: int):
    """Reset ``env`` on each problem and sample ``samples`` answers per agent. Each
    (problem, agent) draws from its own seed, so the answers do not depend on the batching.

    Returns (index -> the env right after reset, index -> {agent: [Completion] * samples}).
    """
    agents = list(env.possible_agents)
    roots, answers = {}, {}
    for start in range(0, len(indices), PROBLEMS_PER_CALL):
        chunk = indices[start : start + PROBLEMS_PER_CALL]
        requests, seeds = [], []
        for i in chunk:
            observations, _ = env.reset(seed=seed, options={"index": i})
            roots[i] = copy.deepcopy(env)
            requests += [(agent, observations[agent]) for agent in agents]
            seeds += [derive_seed(seed, i, k) for k in range(len(agents))]
        groups = iter(policies.sample(requests, samples, params, seeds))
        for i in chunk:
            answers[i] = {agent: next(groups) for agent in agents}
        print(f"  sampled {start + len(chunk)}/{len(indices)} problems", flush=True)
    return roots, answers


def git_commit(path: Path) -> dict[str, object]:
    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True)
        return run.stdout.strip()

    dirty = git("status", "--porcelain", "--", "llm_marl_envs", "magrpo")
    return {"tree": str(path), "commit": git("rev-parse", "HEAD"), "dirty": bool(dirty)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Shares of untrained coding answers that define aux / call it / are cut off."
    )
    p.add_argument("--env", default="coophumaneval")
    p.add_argument("--data", default=None, help="local file or Hub id (default: the env's)")
    p.add_argument("--split", default="train")
    p.add_argument("--samples", type=int, default=2, help="answers per problem per agent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="default: the trainer's default"
    )
    p.add_argument("--temperature", type=float, default=None, help="default: the trainer's default")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems")
    p.add_argument("--label", default="", help="free-text tag stored in the JSON")
    p.add_argument(
        "--out", type=Path, default=REPO / "benchmarks/results/untrained_coding_answers.json"
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    source = Path(llm_marl_envs.__file__).resolve().parent.parent
    print(f"llm_marl_envs: {llm_marl_envs.__file__}, magrpo: {magrpo.__file__}", flush=True)
    env = llm_marl_envs.make(args.env, data=args.data, split=args.split)
    agents = list(env.possible_agents)
    indices = list(range(env.num_items))[: args.limit]
    model = resolve_model(DEFAULTS.model)
    policies = load_policies(agents, [model] * len(agents), **LOAD_OPTIONS)
    # the trainer's default: answers end at the env's stop strings (code that predates the
    # option has neither the option nor the stop strings)
    stop = {}
    if getattr(DEFAULTS, "stop_at_answer_end", False):
        from magrpo.env_contract import answer_stops

        stop = {"stop": answer_stops(env)}
    max_new_tokens = args.max_new_tokens or DEFAULTS.max_new_tokens
    if max_new_tokens is None:  # the trainer's default: the env's answer budget
        from magrpo.env_contract import answer_budget

        max_new_tokens = answer_budget(env)
    temperature = DEFAULTS.temperature if args.temperature is None else args.temperature
    params = SamplingParams(max_new_tokens, temperature, DEFAULTS.top_p, DEFAULTS.top_k, **stop)
    loaded = time.perf_counter()

    roots, answers = sample_problems(policies, env, indices, params, args.samples, args.seed)
    sampled = time.perf_counter()

    flags = {"defines_aux": [], "aux_returns": [], "main_returns": [], "calls_aux": []}
    cut = {agent: [] for agent in agents}
    rewards, parts, records = [], {}, []
    outcomes = defaultdict(list)
    for i in indices:
        root = roots[i]
        entry_point = root.item["entry_point"]
        for g in range(args.samples):
            texts = {agent: answers[i][agent][g].text for agent in agents}
            record = {"index": i, "sample": g, "texts": texts}
            for agent in agents:
                cut[agent].append(not answers[i][agent][g].finished)
                for name, value in analyse(agent, texts[agent], entry_point).items():
                    flags[name].append(value)
                    record[name] = value
            _, reward, _, _, infos = copy.deepcopy(root).step(texts)
            rewards.append(sum(reward.values()) / len(reward))
            info = infos[agents[0]]
            for name, value in test_outcomes(info).items():
                outcomes[name].append(value)
            for name, value in info["reward_parts"].items():
                parts.setdefault(name, []).append(value)
            record.update(reward=rewards[-1], cut={a: cut[a][-1] for a in agents})
            records.append(record)
    scored = time.perf_counter()

    metrics = {
        "aux defines aux with a return": share(flags["aux_returns"]),
        "aux defines aux": share(flags["defines_aux"]),
        "main defines entry point with a return": share(flags["main_returns"]),
        "main calls aux": share(flags["calls_aux"]),
        **{f"{agent} cut off at max_new_tokens": share(cut[agent]) for agent in agents},
        **{name: share(values) for name, values in outcomes.items()},
        "joint reward": mean(rewards),
        **{f"reward part {name}": mean(values) for name, values in parts.items()},
    }
    print(
        f"\n{args.label or 'run'}: {len(indices)} problems x {args.samples} samples, "
        f"max_new_tokens {max_new_tokens}, temperature {temperature}\n"
    )
    print("| metric | value | SE | n |\n| --- | ---: | ---: | ---: |")
    for name, m in metrics.items():
        print(f"| {name} | {m['value']:.3f} | {m['se']:.3f} | {m['n']} |")
    seconds = dict(load=loaded - started, sample=sampled - loaded, score=scored - sampled)
    seconds["total"] = scored - started
    print("\nseconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))

    pythonpath = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    result = {
        "label": args.label,
        "command": pythonpath + shlex.join([sys.executable, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "code": {**git_commit(source), "magrpo": magrpo.__file__},
        "model": {"id": DEFAULTS.model or DEFAULT_MODEL, "path": model},
        "config": {
            **{k: v for k, v in vars(args).items() if k != "out"},
            "problems": indices,
            "sampling": dataclasses.asdict(params),
            "load": LOAD_OPTIONS,
        },
        "machine": {"torch_threads": torch.get_num_threads(), "load_avg": os.getloadavg()},
        "seconds": seconds,
        "metrics": metrics,
        "samples": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
