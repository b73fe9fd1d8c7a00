"""Does MAGRPO training improve the agents? Train, then score every checkpoint on held-out data.

    python benchmarks/learning.py coophumaneval \\
        --data ../shared/data/coophumaneval/coophumaneval.json --steps 100 --eval-every 25
    python benchmarks/learning.py tldr --data examples/data/tldr_synthetic \\
        --steps 100 --eval-every 25

1. **Train** with the trainer's own command, ``python -m magrpo.train``, on the env's train
   split (its defaults, i.e. ``configs/cpu.yaml``, plus ``--steps`` and ``--train-args``),
   saving a checkpoint every ``--eval-every`` steps. It resumes when the run was killed.
2. **Evaluate** step 0 (fresh adapters: the untrained model) and every checkpoint on the whole
   held-out split (the env's evaluation split; never seen in training, never used to choose
   a setting). Each agent answers every problem ``--samples`` times, sampled with the run's
   own sampling settings (temperature, top_p, max_new_tokens, stop strings); answer g of every
   agent forms joint action g, which the env scores. The seeds depend on (problem, agent) only,
   so every checkpoint is evaluated with the same random numbers, which lowers the noise of
   the before/after difference.
3. **Report** every metric as the mean over problems of the per-problem mean, with its
   standard error over problems (the problems are the independent units; the samples of one
   problem are not), and the paired difference to step 0 with its standard error. Writes
   ``benchmarks/results/learning_<env>.json`` (the command, the git commit, the machine, every
   sampled answer) and a PNG of the curves (``--plot``).

The report also gives the training side (``training_side``): the training reward per third
of the run, and its paired change per prompt between visits when the run passed over the
train split more than once.

Metrics: ``joint reward`` (the env's, averaged over agents), ``cut off`` (share of answers
that hit ``max_new_tokens``) and the env's reward parts; for coding envs also ``helper defines
aux``, ``main calls aux`` (main's entry point contains a call ``aux(...)``), ``pass rate``
(every assert passes) and ``cooperation`` (the helper's ``aux`` ran during at least one
passing assert, i.e. the cooperation bonus was paid); for writing envs also ``copied, <agent>``
(the share of the agent's six-word runs copied word for word from the source, which the
reward's first level caps).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from untrained_coding_answers import git_commit, mean, sample_problems, test_outcomes

import llm_marl_envs
from magrpo.checkpoint import list_checkpoints, load_checkpoint
from magrpo.config import MAGRPOConfig
from magrpo.data_order import DataOrder
from magrpo.env_contract import answer_stops
from magrpo.loading import load_policies
from magrpo.models import resolve_model
from magrpo.policies import SamplingParams

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("env", help="env id, e.g. coophumaneval or tldr")
    p.add_argument("--data", help="local data file/folder or Hub id (default: the env's)")
    p.add_argument("--train-split", default="train")
    p.add_argument("--eval-split", help="held-out split (default: the env's evaluation split)")
    p.add_argument("--steps", type=int, default=100, help="training steps")
    p.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    p.add_argument("--samples", type=int, default=4, help="sampled answers per problem")
    p.add_argument("--limit", type=int, help="evaluate only the first N held-out problems")
    p.add_argument("--seed", type=int, default=0, help="evaluation seed")
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument(
        "--train-args", default="", help="extra magrpo.train arguments, e.g. '--learning-rate 2e-4'"
    )
    p.add_argument("--run-dir", type=Path, help="default: runs/learning/<env>")
    p.add_argument("--out", type=Path, help="default: benchmarks/results/learning_<env>.json")
    p.add_argument("--plot", type=Path, help="PNG of the curves (default: none)")
    return p.parse_args(argv)


def train(args: argparse.Namespace, run_dir: Path) -> None:
    command = [
        sys.executable, "-m", "magrpo.train", "--env", args.env,
        "--train-split", args.train_split, "--max-steps", str(args.steps),
        "--save-interval", str(args.eval_every), "--save-total-limit", "0",
        "--eval-interval", "0", "--torch-threads", str(args.torch_threads),
        "--output-dir", str(run_dir), "--resume", "--no-progress-bar",
        *(["--data", args.data] if args.data else []),
        *shlex.split(args.train_args),
    ]  # fmt: skip
    print("$ " + shlex.join(command), flush=True)
    subprocess.run(command, check=True)


def checkpoints_to_evaluate(run_dir: Path, steps: int, every: int) -> dict[int, Path | None]:
    """Step 0 (no checkpoint: fresh adapters) and the checkpoint of every ``every`` steps."""
    found = {int(path.name.removeprefix("step-")): path for path in list_checkpoints(run_dir)}
    wanted = [0, *range(every, steps + 1, every), steps]
    missing = [step for step in wanted if step and step not in found]
    if missing:
        raise SystemExit(f"{run_dir} has no checkpoint for steps {missing}: train first.")
    return {step: found.get(step) for step in dict.fromkeys(wanted)}


def coding_facts(infos: dict) -> dict[str, float]:
    outcome = test_outcomes(infos)
    return {
        "helper defines aux": float(bool(infos.get("aux_defined"))),
        "main calls aux": float(bool(infos.get("main_calls_aux"))),
        "pass rate": float(outcome["all asserts pass"]),
        "cooperation": float(outcome["cooperation bonus paid"]),
    }


def evaluate(policies, env, params: SamplingParams, args) -> tuple[dict, list]:
    """Score ``args.samples`` joint answers per held-out problem; per-problem metric means."""
    agents = list(env.possible_agents)
    problems = list(range(env.num_items))[: args.limit]
    per_problem: dict[str, list[float]] = {}
    records = []
    roots, answers = sample_problems(policies, env, problems, params, args.samples, args.seed)
    for i in problems:
        values: dict[str, list[float]] = {}
        for g in range(args.samples):
            texts = {agent: answers[i][agent][g].text for agent in agents}
            _, rewards, _, _, infos = copy.deepcopy(roots[i]).step(texts)
            info = infos[agents[0]]
            row = {"joint reward": sum(rewards.values()) / len(rewards)}
            cut = {agent: not answers[i][agent][g].finished for agent in agents}
            row["cut off"] = sum(cut.values()) / len(agents)
            if "tests_total" in info:
                row.update(coding_facts(info))
            if "copied_first" in info:  # writing envs: how much of each text is the source's
                first, second = agents
                row[f"copied, {first}"] = info["copied_first"]
                row[f"copied, {second}"] = info["copied_second"]
            row.update({f"part {k}": v for k, v in info.get("reward_parts", {}).items()})
            for name, value in row.items():
                values.setdefault(name, []).append(value)
            records.append({"problem": i, "sample": g, "texts": texts, "cut": cut, **row})
        for name, vals in values.items():
            per_problem.setdefault(name, []).append(sum(vals) / len(vals))
    return per_problem, records


class HeldOut:
    """The held-out split of a run's env, and the run's agents with any checkpoint's weights."""

    def __init__(self, config: MAGRPOConfig, args: argparse.Namespace):
        self.args = args
        self.split = args.eval_split or llm_marl_envs.default_eval_split(config.env)
        self.env = llm_marl_envs.make(config.env, data=args.data, split=self.split)
        agents = list(self.env.possible_agents)
        self.policies = load_policies(
            agents, [resolve_model(config.model)] * len(agents), finetune=config.finetune,
            lora_rank=config.lora_rank, lora_alpha=config.lora_alpha,
            lora_target_modules=config.lora_target_modules, dtype=config.dtype,
            use_chat_template=config.use_chat_template,
        )  # fmt: skip
        trainable = self.policies.named_trainable_parameters
        self.fresh = {a: {n: p.detach().clone() for n, p in trainable(a).items()} for a in agents}
        self.stop = answer_stops(self.env) if config.stop_at_answer_end else {}
        self.params = SamplingParams(
            config.max_new_tokens, config.temperature, config.top_p, config.top_k, self.stop
        )

    def score(self, checkpoint: Path | None) -> tuple[dict, list]:
        """``evaluate`` with a checkpoint's weights (None: fresh adapters, the untrained model)."""
        weights = self.fresh if checkpoint is None else load_checkpoint(checkpoint)["weights"]
        with torch.no_grad():
            for agent in self.fresh:
                for name, param in self.policies.named_trainable_parameters(agent).items():
                    param.copy_(weights[agent][name])
        return evaluate(self.policies, self.env, self.params, self.args)

    def sampling(self) -> dict:
        return {**vars(self.params), "stop": {a: list(s) for a, s in self.stop.items()}}


def summarise(results: dict) -> dict:
    """Per evaluation and metric: mean ± SE over problems, and the paired change from the
    first evaluation (the untrained model) ± its SE."""
    before = next(iter(results.values()))
    table = {}
    for step, per_problem in results.items():
        table[str(step)] = {}
        for name, values in per_problem.items():
            row = mean(values)
            row["change"] = mean([a - b for a, b in zip(values, before[name], strict=True)])
            table[str(step)][name] = row
    return table


def training_side(run_dir: Path, config: MAGRPOConfig, num_items: int | None) -> dict:
    """What the optimiser did on the data it trains on, from the run's ``metrics.jsonl``: the
    mean training reward in each third of the run and, when the run visited its prompts more
    than once (one prompt per step), the paired change of a prompt's training reward from its
    first visit to its second and third (the prompts replayed in the trainer's own data order).
    A rise here beside a flat held-out curve means the agents learnt their training prompts and
    it did not carry over."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = {row["step"]: row["reward/mean"] for row in rows if "reward/mean" in row}
    steps = sorted(rewards)
    thirds = [steps[i * len(steps) // 3 : (i + 1) * len(steps) // 3] for i in range(3)]
    side: dict = {
        f"reward, steps {part[0]}-{part[-1]}": mean([rewards[s] for s in part])
        for part in thirds
        if part
    }
    if config.prompts_per_step == 1 and num_items and steps:
        order, visits = DataOrder(num_items, config.seed), defaultdict(list)
        for step in range(1, steps[-1] + 1):
            index, _ = order.next()
            if step in rewards:
                visits[index].append(rewards[step])
        for k in (2, 3):
            changes = [v[k - 1] - v[0] for v in visits.values() if len(v) >= k]
            if len(changes) > 1:
                side[f"reward, visit {k} - visit 1 of a prompt"] = mean(changes)
    return side


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in result["metrics"] if not n.startswith("part ")]
    if len(names) < 3:  # a task without metrics of its own: show its reward parts instead
        names = result["metrics"]
    rows = -(-len(names) // 5)
    columns = -(-len(names) // rows)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 3.0 * rows + 0.4),
                             squeeze=False)  # fmt: skip
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    steps = [int(s) for s in result["steps"]]
    for ax, name in zip(axes.flat, names, strict=False):  # more axes than names: hidden
        points = [result["steps"][str(s)][name] for s in steps]
        ax.errorbar(steps, [p["value"] for p in points], yerr=[p["se"] for p in points], marker="o",
                    capsize=3)  # fmt: skip
        ax.set_title(name)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"{result['env']}: held-out, {result['samples']} sampled answers per problem "
        f"(mean ± SE over {result['problems']} problems)",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    env_name = llm_marl_envs.resolve_env_id(args.env)
    run_dir = args.run_dir or REPO / "runs" / "learning" / env_name
    out = args.out or REPO / "benchmarks" / "results" / f"learning_{env_name.split('-')[0]}.json"
    started = time.perf_counter()
    train(args, run_dir)
    trained = time.perf_counter()

    config = MAGRPOConfig(**json.loads((run_dir / "config.json").read_text()))
    held_out = HeldOut(config, args)
    results, samples, seconds = {}, {}, {}
    for step, path in checkpoints_to_evaluate(run_dir, args.steps, args.eval_every).items():
        print(f"step {step}: evaluating", flush=True)
        t0 = time.perf_counter()
        results[step], samples[step] = held_out.score(path)
        seconds[f"eval step {step}"] = time.perf_counter() - t0

    table = summarise(results)
    last = table[str(args.steps)]
    print(f"\n{env_name}: held-out {held_out.split}, {args.samples} samples per problem\n")
    print(f"| metric | step 0 | step {args.steps} | change |\n| --- | ---: | ---: | ---: |")
    for name, row in last.items():
        first = table["0"][name]
        print(
            f"| {name} | {first['value']:.3f} ± {first['se']:.3f} | {row['value']:.3f} ± "
            f"{row['se']:.3f} | {row['change']['value']:+.3f} ± {row['change']['se']:.3f} |"
        )
    train_env = llm_marl_envs.make(config.env, data=args.data, split=args.train_split)
    training = training_side(run_dir, config, getattr(train_env, "num_items", None))
    print("\ntraining side (mean ± SE over steps, or over prompts for a change):")
    for name, row in training.items():
        print(f"  {name}: {row['value']:+.3f} ± {row['se']:.3f} (n = {row['n']})")
    seconds.update(train=trained - started, total=time.perf_counter() - started)
    result = {
        "env": env_name,
        **provenance(args),
        "train_config": config.to_dict(),
        "eval_split": held_out.split,
        "problems": len(next(iter(results[0].values()))),
        "samples": args.samples,
        "sampling": held_out.sampling(),
        "seconds": seconds,
        "metrics": list(last),
        "steps": table,
        "training": training,
        "answers": {str(step): records for step, records in samples.items()},
    }
    write_result(result, out, args.plot, plot)
    return 0


def provenance(args: argparse.Namespace) -> dict:
    """The command, the date, the code's commit and the machine of a result."""
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "code": git_commit(REPO),
        "machine": {"cpus": os.cpu_count(), "torch_threads": args.torch_threads},
    }


def write_result(result: dict, out: Path, plot_to: Path | None, plot_fn) -> None:
    """The result as JSON, and ``plot_fn``'s PNG of it when ``plot_to`` is given."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    if plot_to:
        plot_fn(result, plot_to)
        print(f"wrote {plot_to}")


if __name__ == "__main__":
    sys.exit(main())
