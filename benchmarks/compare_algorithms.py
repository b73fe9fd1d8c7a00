"""MAGRPO, IAC and MAAC at equal wall-clock: held-out joint reward against training time.

    python benchmarks/compare_algorithms.py tldr --data examples/data/tldr_synthetic \\
        --minutes 12 --limit 12 --plot docs/img/algorithms_tldr.png

1. **Train** each algorithm with ``python -m magrpo.train`` on the env's train split, for the
   same wall-clock budget (``--max-train-minutes``), one after another on the same machine,
   saving a checkpoint every ``--save-every`` steps. MAGRPO runs with its defaults (G = 4
   samples per agent from one prompt per step); IAC and MAAC with one sample per agent from
   ``--ac-prompts`` prompts per step, as the authors' library runs them: the same number of
   completions per step. Every other setting is the trainer's default (``configs/cpu.yaml``).
2. **Evaluate** the untrained model once (it is the same for all three) and, per algorithm,
   the checkpoint nearest to half its budget and its last one, on the held-out split:
   ``--samples`` sampled answers per problem, as ``learning.py`` does (same seeds for every
   checkpoint, so differences are paired).
3. **Report** the held-out joint reward (mean ± SE over problems) against training minutes
   (from the runs' own ``time/step``), the change from the untrained model with its paired
   SE, steps done, and each run's last training loss and critic loss. Writes
   ``benchmarks/results/algorithms_<env>.json`` and the PNG (``--plot``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from learning import HeldOut, provenance, summarise, write_result

import llm_marl_envs
from magrpo.checkpoint import list_checkpoints
from magrpo.config import MAGRPOConfig

REPO = Path(__file__).resolve().parent.parent
ALGORITHMS = ("magrpo", "iac", "maac")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("env", help="env id, e.g. tldr")
    p.add_argument("--data", help="local data file/folder or Hub id (default: the env's)")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    p.add_argument("--minutes", type=float, default=12.0, help="training budget per algorithm")
    p.add_argument("--save-every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--ac-prompts", type=int, default=4, help="prompts per step for iac/maac")
    p.add_argument("--samples", type=int, default=4, help="sampled answers per problem")
    p.add_argument("--limit", type=int, help="evaluate only the first N held-out problems")
    p.add_argument("--eval-split", help="held-out split (default: the env's evaluation split)")
    p.add_argument("--seed", type=int, default=0, help="evaluation seed")
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--train-args", default="", help="extra magrpo.train arguments for all")
    p.add_argument("--run-dir", type=Path, help="default: runs/algorithms/<env>")
    p.add_argument("--out", type=Path, help="default: benchmarks/results/algorithms_<env>.json")
    p.add_argument("--plot", type=Path, help="PNG of the curves (default: none)")
    return p.parse_args(argv)


def train(args: argparse.Namespace, algorithm: str, run_dir: Path) -> None:
    own = [] if algorithm == "magrpo" else [
        "--group-size", "1", "--prompts-per-step", str(args.ac_prompts),
    ]  # fmt: skip
    command = [
        sys.executable, "-m", "magrpo.train", "--env", args.env, "--algorithm", algorithm,
        "--max-train-minutes", str(args.minutes), "--max-steps", "100000",
        "--save-interval", str(args.save_every), "--save-total-limit", "0",
        "--eval-interval", "0", "--torch-threads", str(args.torch_threads),
        "--output-dir", str(run_dir), "--no-progress-bar",
        *(["--data", args.data] if args.data else []), *own, *shlex.split(args.train_args),
    ]  # fmt: skip
    print("$ " + shlex.join(command), flush=True)
    subprocess.run(command, check=True)


def training_log(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "time/step" in r]


def main(argv=None) -> int:
    args = parse_args(argv)
    env_name = llm_marl_envs.resolve_env_id(args.env)
    run_root = args.run_dir or REPO / "runs" / "algorithms" / env_name
    out = args.out or REPO / "benchmarks" / "results" / f"algorithms_{env_name.split('-')[0]}.json"
    for algorithm in args.algorithms:
        if not (run_root / algorithm / "adapters").is_dir():  # not yet trained to the end
            train(args, algorithm, run_root / algorithm)

    held_out = None
    results: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    for algorithm in args.algorithms:
        run_dir = run_root / algorithm
        config = MAGRPOConfig(**json.loads((run_dir / "config.json").read_text()))
        if held_out is None:
            held_out = HeldOut(config, args)
            print("untrained model: evaluating", flush=True)
            untrained, _ = held_out.score(None)
        log = training_log(run_dir)
        minutes = [0.0, *itertools.accumulate(r["time/step"] / 60 for r in log)]  # after step i
        checkpoints = {int(p.name.removeprefix("step-")): p for p in list_checkpoints(run_dir)}
        last = max(checkpoints)
        middle = min(checkpoints, key=lambda step: abs(minutes[step] - minutes[last] / 2))
        scores = {0: untrained}
        for step in sorted({middle, last}):
            print(f"{algorithm} step {step}: evaluating", flush=True)
            scores[step], _ = held_out.score(checkpoints[step])
        table = summarise(scores)
        results[algorithm] = {
            str(step): {"minutes": minutes[step], **table[str(step)]} for step in scores
        }
        runs[algorithm] = {
            "steps": last,
            "config": config.to_dict(),
            "last_losses": {k: v for k, v in log[-1].items() if k.startswith(("loss", "critic/"))},
            "train_reward_last5": sum(r["reward/mean"] for r in log[-5:]) / len(log[-5:]),
        }

    print(f"\n{env_name}: held-out {held_out.split}, {args.samples} samples per problem\n")
    print("| algorithm | steps in budget | untrained | trained | change |\n| --- | ---: | ---: | ---: | ---: |")  # noqa: E501
    for algorithm, table in results.items():
        first, final = table["0"]["joint reward"], table[str(runs[algorithm]["steps"])]
        reward = final["joint reward"]
        print(
            f"| {algorithm} | {runs[algorithm]['steps']} | {first['value']:.3f} ± {first['se']:.3f}"
            f" | {reward['value']:.3f} ± {reward['se']:.3f} | {reward['change']['value']:+.3f}"
            f" ± {reward['change']['se']:.3f} |"
        )
    result = {
        "env": env_name,
        **provenance(args),
        "budget_minutes": args.minutes,
        "eval_split": held_out.split,
        "problems": len(untrained["joint reward"]),
        "samples": args.samples,
        "sampling": held_out.sampling(),
        "runs": runs,
        "results": results,
    }
    write_result(result, out, args.plot, plot)
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for algorithm, table in result["results"].items():
        points = sorted(table.values(), key=lambda row: row["minutes"])
        steps = result["runs"][algorithm]["steps"]
        ax.errorbar(
            [p["minutes"] for p in points],
            [p["joint reward"]["value"] for p in points],
            yerr=[p["joint reward"]["se"] for p in points],
            marker="o", capsize=3, label=f"{algorithm} ({steps} steps)",
        )  # fmt: skip
    ax.set_xlabel("training wall-clock (minutes)")
    ax.set_ylabel("held-out joint reward")
    ax.set_title(
        f"{result['env']}: {result['problems']} held-out problems x {result['samples']} samples"
        " (mean ± SE)",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"{time.perf_counter() - started:.0f} s")
    sys.exit(code)
