"""How our trainer's step time grows with G, the number of agents and the number of turns.

    .venv/bin/python benchmarks/scaling.py                       # all three sweeps + plot
    .venv/bin/python benchmarks/scaling.py --sweeps group_size --steps 2

Settings as in ``compare_comlrl.py`` (SmolLM2-135M, LoRA r=8 q/v, 64 new tokens, raw prompts,
one prompt per step, CoopHumanEval train split, 2 torch threads), one knob changed at a time:

- ``group_size``: G in 2, 4, 8, 16 (2 agents, 1 turn). Work: 2G completions per step.
- ``agents``: N in 2, 3, 4 (G=4, 1 turn). CoopHumanEval has two roles; extra agents are
  additional helpers that get the helper's prompt, and every helper's code goes into the
  program (so the reward stays one sandbox run per joint action). Work: N*G completions.
- ``turns``: H in 1, 2, 3 (G=4, 2 agents, aligned joints, no early termination). The tree
  has 1 + G + ... + G^(H-1) nodes (1, 5, 21), each node 2G completions; later turns have
  longer prompts (own previous answer + test feedback). Work: the number of completions.

Every completion is trained (``equal_work.py``), so a step's work does not depend on the
rewards drawn (as shipped, a group whose rewards are all equal skips its update).
Each point runs in its own subprocess (fresh memory); the expected time is the smallest
point's measured time times the growth of the work (completions), written beside the
measured time, with the ratio measured/expected (< 1: batching makes it grow slower than the
work). Results: ``benchmarks/.results/scaling.json``, a Markdown table on stdout, and a plot
(``--plot``, default docs/img/scaling.png).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / ".results"
DEFAULT_DATA = REPO.parent / "shared" / "data" / "coophumaneval" / "coophumaneval.json"
SWEEPS = {
    "group_size": [2, 4, 8, 16],
    "agents": [2, 3, 4],
    "turns": [1, 2, 3],
}


def work(sweep: str, value: int, group_size: int = 4) -> int:
    """Completions sampled (and trained on) per step."""
    if sweep == "group_size":
        return 2 * value
    if sweep == "agents":
        return value * group_size
    nodes = sum(group_size**t for t in range(value))
    return nodes * 2 * group_size


# --- one point, in a child process -----------------------------------------------------------
def make_n_agent_env(data: str, split: str, num_agents: int, max_turns: int):
    """CoopHumanEval with ``num_agents - 1`` helpers (aux, aux2, ...) and the main agent."""
    import llm_marl_envs
    from llm_marl_envs.env import TextParallelEnv
    from llm_marl_envs.tasks import CoopHumanEvalTask

    base = llm_marl_envs.make("coophumaneval-v2", data=data, split=split, max_turns=max_turns)
    if num_agents == 2:
        return base
    helpers = ["aux"] + [f"aux{i}" for i in range(2, num_agents)]

    class ManyHelpersTask(CoopHumanEvalTask):
        roles = (*helpers, "main")

        def prompts(self, item):
            first = super().prompts(item)
            return {**{h: first["aux"] for h in helpers}, "main": first["main"]}

        def evaluate(self, item, actions):
            joined = "\n\n".join(actions[h] for h in helpers)
            return super().evaluate(item, {"aux": joined, "main": actions["main"]})

    task = ManyHelpersTask(base.task.records, sandbox_settings=base.task.sandbox_settings)
    return TextParallelEnv(task, max_turns=max_turns)


def run_point(spec: dict) -> dict:
    import torch
    from equal_work import EqualWorkTrainer

    from magrpo.config import MAGRPOConfig

    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as out_dir:
        config = MAGRPOConfig(
            env="coophumaneval-v2", data=spec["data"], train_split=spec["split"],
            model=spec["model"], finetune="lora", lora_rank=8, lora_alpha=16.0,
            lora_target_modules=["q_proj", "v_proj"], use_chat_template=False,
            group_size=spec["group_size"], max_new_tokens=spec["max_new_tokens"],
            temperature=0.8, top_p=0.95, top_k=0, learning_rate=1e-4, max_grad_norm=None,
            num_turns=spec["turns"], joint_mode="aligned", early_termination_threshold=None,
            max_steps=spec["warmup"] + spec["steps"], prompts_per_step=1, eval_interval=0,
            save_interval=0, log_backends=["jsonl"], torch_threads=spec["threads"],
            seed=spec["seed"], output_dir=out_dir, progress_bar=False,
        )
        env = make_n_agent_env(spec["data"], spec["split"], spec["agents"], spec["turns"])
        trainer = EqualWorkTrainer(config, env)  # every completion trained: constant work
        steps = []
        for k in range(spec["warmup"] + spec["steps"]):
            metrics = trainer.train_step()
            if k >= spec["warmup"]:
                steps.append({
                    "seconds": metrics["time/step"],
                    "generate_seconds": metrics["time/generate"],
                    "env_seconds": metrics["time/env"],
                    "update_seconds": metrics["time/update"],
                    "generated_tokens": round(metrics["tokens_per_second"]
                                              * metrics["time/generate"]),
                    "nodes": metrics["num_nodes"],
                    "trained_sequences": metrics.get("trained_sequences"),
                })
        trainer.close()
    return {
        "median_seconds_per_step": statistics.median(s["seconds"] for s in steps),
        "steps": steps,
    }


def child_peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


# --- the sweeps ------------------------------------------------------------------------------
def point_spec(args, sweep: str, value: int) -> dict:
    spec = {
        "model": args.model, "data": str(args.data), "split": args.split,
        "group_size": 4, "agents": 2, "turns": 1, "max_new_tokens": args.max_new_tokens,
        "threads": args.threads, "seed": args.seed, "warmup": args.warmup, "steps": args.steps,
    }
    spec[{"group_size": "group_size", "agents": "agents", "turns": "turns"}[sweep]] = value
    if sweep == "turns" and value >= 3:
        spec["warmup"], spec["steps"] = 0, max(1, args.steps // 2)  # one step is minutes long
    return spec


def run_sweeps(args) -> dict:
    results: dict[str, list[dict]] = {}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    for sweep in args.sweeps:
        points = []
        for value in SWEEPS[sweep]:
            spec = point_spec(args, sweep, value)
            load = os.getloadavg()[0]
            started = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, __file__, "--point", json.dumps(spec)],
                capture_output=True, text=True, env=env, cwd=REPO,
            )
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-3000:])
                raise RuntimeError(f"scaling point {sweep}={value} failed")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            result.update(value=value, work=work(sweep, value), load_1min_before=load,
                          wall_seconds=time.perf_counter() - started)
            points.append(result)
            print(f"{sweep}={value}: {result['median_seconds_per_step']:.2f} s/step "
                  f"(work {result['work']}, load {load:.2f})", flush=True)
        base = points[0]
        for p in points:
            p["expected_seconds"] = base["median_seconds_per_step"] * p["work"] / base["work"]
            p["measured_over_expected"] = p["median_seconds_per_step"] / p["expected_seconds"]
        results[sweep] = points
    return results


def markdown(results: dict) -> str:
    names = {"group_size": "G", "agents": "agents N", "turns": "turns H"}
    lines = ["| knob | value | completions/step | s/step measured | s/step expected "
             "(∝ work) | measured / expected |", "| --- | --- | --- | --- | --- | --- |"]
    for sweep, points in results.items():
        for p in points:
            lines.append(
                f"| {names[sweep]} | {p['value']} | {p['work']} | "
                f"{p['median_seconds_per_step']:.2f} | {p['expected_seconds']:.2f} | "
                f"{p['measured_over_expected']:.2f} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path, max_new_tokens: int = 64) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"group_size": "group size G (N=2, H=1)", "agents": "agents N (G=4, H=1)",
              "turns": "turns H (G=4, N=2, aligned)"}
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4))
    axes = [axes] if len(results) == 1 else list(axes)
    for ax, (sweep, points) in zip(axes, results.items(), strict=True):
        xs = [p["value"] for p in points]
        ax.plot(xs, [p["median_seconds_per_step"] for p in points], "o-", label="measured")
        ax.plot(xs, [p["expected_seconds"] for p in points], "s--", color="grey",
                label="expected (∝ completions)")
        ax.set_xticks(xs)
        ax.set_xlabel(titles[sweep])
        ax.set_ylabel("seconds per step")
        if sweep in ("group_size", "turns"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"MAGRPO step time, {os.cpu_count()} CPU cores\n(SmolLM2-135M, LoRA r=8 q/v, "
                 f"{max_new_tokens} new tokens)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--point", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sweeps", nargs="+", default=list(SWEEPS), choices=list(SWEEPS))
    p.add_argument("--model", default=None, help="Model folder (default: resolve_model()).")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--split", default="train")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "scaling.png")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.point is not None:
        print(json.dumps(run_point(json.loads(args.point))), flush=True)
        return 0
    if args.model is None:
        from magrpo.models import resolve_model

        args.model = resolve_model(None)
    results = run_sweeps(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    previous = {}
    out = RESULTS / "scaling.json"
    if out.exists():
        previous = json.loads(out.read_text()).get("results", {})
    merged = {**previous, **results}
    out.write_text(json.dumps({"results": merged, "cpu_count": os.cpu_count(),
                               "max_new_tokens": args.max_new_tokens}, indent=2))
    print(markdown(merged))
    if args.plot:
        plot({k: merged[k] for k in SWEEPS if k in merged}, args.plot, args.max_new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
