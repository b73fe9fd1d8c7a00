"""Where the time of one MAGRPO training step goes (our trainer, CPU).

    .venv/bin/python benchmarks/profile_step.py                 # LoRA, the compare settings
    .venv/bin/python benchmarks/profile_step.py --finetune full --steps 3 --torch-profile update

Builds the trainer in-process with the settings of ``compare_comlrl.py`` (SmolLM2-135M,
2 agents, G=4, 64 new tokens, raw prompts, one prompt per step, every completion trained as
in ``equal_work.py``; ``--dtype bfloat16`` for the bf16 runs), runs ``--warmup`` steps, then
times ``--steps`` steps phase by phase by wrapping the trainer's own calls:

- generate:  ``Policies.sample`` (tokenise, prefill, our decode loop, detokenise)
- reward:    env steps of the joint actions (deep copy, reward, sandboxed tests), in threads
- log-probs: ``Policies.logprobs`` (the forward pass with grad, per micro-batch)
- backward:  ``accelerator.backward``
- optimizer: gradient clipping + AdamW steps
- overhead:  the rest (env resets and copies, advantages, batching, metrics)

Each step also records every phase's peak resident memory (this process's ``VmHWM``, reset
before each call; sandbox children not included), in GiB.

``--torch-profile step|update|generate`` also records one step (or one phase of it) with
``torch.profiler`` and prints the top operators by self CPU time.
``--plot PATH`` draws the breakdown as a PNG. Results: JSON on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data" / "coophumaneval" / "coophumaneval.json"
PHASES = ("generate", "reward", "log-probs", "backward", "optimizer", "overhead")


def build_trainer(args, output_dir: str):
    import torch
    from equal_work import EqualWorkTrainer

    from magrpo.config import MAGRPOConfig
    from magrpo.train import make_env

    torch.set_num_threads(args.threads)
    config = MAGRPOConfig(
        env=args.env, data=str(args.data), train_split=args.split, model=args.model,
        finetune=args.finetune, dtype=args.dtype, lora_rank=8, lora_alpha=16.0,
        lora_target_modules=["q_proj", "v_proj"], use_chat_template=False, joint_mode="aligned",
        group_size=args.group_size, max_new_tokens=args.max_new_tokens, temperature=0.8,
        top_p=0.95, top_k=0, learning_rate=1e-4, max_grad_norm=None,
        max_steps=args.warmup + args.steps, prompts_per_step=1, num_turns=args.num_turns,
        **({"micro_batch_size": args.micro_batch_size} if args.micro_batch_size else {}),
        eval_interval=0, save_interval=0,
        log_backends=["jsonl"], torch_threads=args.threads, seed=args.seed,
        output_dir=output_dir, progress_bar=False,
        gradient_checkpointing=args.gradient_checkpointing,
        optimizer_in_backward=args.optimizer_in_backward,
        reuse_sampled_states=args.reuse_sampled_states,
        sample_side_by_side=args.sample_side_by_side, cpu_heap=args.cpu_heap,
    )
    return EqualWorkTrainer(config, make_env(config, args.split))


class PhaseTimer:
    """Wraps the trainer's calls so that each step's time splits into PHASES."""

    def __init__(self, trainer):
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.peaks: dict[str, float] = defaultdict(float)  # GiB resident, per phase
        policies = trainer.policies
        policies.sample = self._wrap(policies.sample, "generate")
        policies.logprobs = self._wrap(policies.logprobs, "log-probs")
        trainer.accelerator.backward = self._wrap(trainer.accelerator.backward, "backward")
        trainer.accelerator.clip_grad_norm_ = self._wrap(
            trainer.accelerator.clip_grad_norm_, "optimizer"
        )
        for optimizer in trainer.optimizers.values():
            optimizer.step = self._wrap(optimizer.step, "optimizer")

    def _wrap(self, fn, phase: str):
        def timed(*args, **kwargs):
            _reset_peak_rss()
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - started
                self.calls[phase] += 1
                self.peaks[phase] = max(self.peaks[phase], _peak_rss_gib())

        return timed

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()
        self.peaks.clear()


def _reset_peak_rss() -> None:
    """Start this process's resident high-water mark (VmHWM) afresh (Linux; else a no-op)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_gib() -> float:
    """This process's resident high-water mark since the last reset (0 where unknown)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def torch_profile_step(trainer, scope: str) -> str:
    """Top operators by self CPU time of one step, or of one phase of it (update/generate)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if scope == "step":
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step()
    else:
        owner, name = (trainer, "update") if scope == "update" else (trainer.policies, "sample")
        original = getattr(owner, name)
        holder = {}

        def profiled(*args, **kwargs):
            with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
                result = original(*args, **kwargs)
            holder["prof"] = p
            return result

        setattr(owner, name, profiled)
        try:
            trainer.train_step()
        finally:
            setattr(owner, name, original)
        prof = holder.get("prof")
        if prof is None:
            return f"(no {scope} call in the profiled step)"
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def profile(args) -> dict:
    import torch

    with tempfile.TemporaryDirectory(prefix="bench-profile-") as out_dir:
        trainer = build_trainer(args, out_dir)
        timer = PhaseTimer(trainer)
        for _ in range(args.warmup):
            trainer.train_step()
        steps = []
        for _ in range(args.steps):
            timer.reset()
            started = time.perf_counter()
            metrics = trainer.train_step()
            total = time.perf_counter() - started
            phases = dict(timer.totals)
            phases["reward"] = metrics["time/env"]
            phases["overhead"] = total - sum(phases.get(p, 0.0) for p in PHASES if p != "overhead")
            steps.append({
                "seconds": total,
                "phases": {p: phases.get(p, 0.0) for p in PHASES},
                "calls": dict(timer.calls),
                "peak_rss_gib": dict(timer.peaks),
                "generated_tokens": round(metrics["tokens_per_second"] * metrics["time/generate"]),
                "trained_sequences": metrics.get("trained_sequences"),
                "completion_length": {k.split("/", 1)[1]: v for k, v in metrics.items()
                                      if k.startswith("completion_length/")},
            })
        top_ops = None
        if args.torch_profile:
            top_ops = torch_profile_step(trainer, args.torch_profile)
        trainer.close()
    median_total = statistics.median(s["seconds"] for s in steps)
    median_phases = {p: statistics.median(s["phases"][p] for s in steps) for p in PHASES}
    return {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch_threads": torch.get_num_threads(),
        "median_seconds_per_step": median_total,
        "median_phase_seconds": median_phases,
        "phase_share": {p: median_phases[p] / sum(median_phases.values()) for p in PHASES},
        "steps": steps,
        "top_ops": top_ops,
    }


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = result["median_phase_seconds"]
    fig, ax = plt.subplots(figsize=(7, 2.4))
    left = 0.0
    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    for (name, seconds), colour in zip(phases.items(), colours, strict=True):
        ax.barh([0], [seconds], left=left, color=colour, label=f"{name} {seconds:.2f}s")
        left += seconds
    ax.set_yticks([])
    ax.set_title(f"{title}: seconds, median step")
    ax.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def parse_args(argv=None):
    from magrpo.config import CPU_HEAP_POLICIES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Model folder (default: resolve_model()).")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--env", default="coophumaneval-v2")
    p.add_argument("--split", default="train")
    p.add_argument("--finetune", choices=("lora", "full"), default="lora")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-turns", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="Completions per forward/backward (default: the trainer's default).")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="The memory option of the same name (see README).")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="The memory option of the same name (see README).")
    p.add_argument("--reuse-sampled-states", action="store_true",
                   help="The memory option of the same name (see README).")
    p.add_argument("--sample-side-by-side", action=argparse.BooleanOptionalAction,
                   default=True, help="The trainer option of the same name (see README).")
    p.add_argument("--cpu-heap", choices=CPU_HEAP_POLICIES, default="auto",
                   help="The trainer option of the same name (see README).")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--torch-profile", choices=("step", "update", "generate"), default=None,
                   help="Also run one step under torch.profiler (all of it, or one phase).")
    p.add_argument("--plot", type=Path, default=None, help="Write the breakdown as a PNG.")
    p.add_argument("--out", type=Path, default=None, help="Also write the JSON here.")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from magrpo.models import resolve_model

        args.model = resolve_model(None)
    result = profile(args)
    text = json.dumps({k: v for k, v in result.items() if k != "top_ops"}, indent=2)
    print(text)
    if result["top_ops"]:
        print(result["top_ops"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot, f"One MAGRPO step ({args.finetune}, G={args.group_size}, "
                                f"{args.max_new_tokens} new tokens, 2 agents)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
