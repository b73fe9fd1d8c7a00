"""A step's products with oneDNN on the plain weights against the BLAS library (MKL), in one
process, alternating: what ``magrpo.speedups.onednn.plain_weights_pay`` decides per CPU.

    .venv/bin/python benchmarks/update_kernels.py                      # LoRA, 6 rounds
    .venv/bin/python benchmarks/update_kernels.py --finetune full --reuse-sampled-states \\
        --optimizer-in-backward --no-sample-side-by-side
    .venv/bin/python benchmarks/update_kernels.py --same-rollout --rounds 10   # updates only

Each round runs one training step (a new rollout, and the update on it) with each kernel
choice, the order alternating between rounds, on the trainer and settings of
``profile_step.py``. The choice
applies to the prefill of sampling and to the update's forward and input gradients; decode
steps use packed oneDNN weights either way. Prints the median seconds of sampling and of
the update per choice. Alternating in one process cancels most of a shared VM's drift.
The prompts and completions differ from step to step, and with them the work (the update
varied by +-0.8 s between steps of one run): ``--same-rollout`` instead runs every round's
updates on one rollout, sampled once after the warm-up step, which compares updates on
equal work.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import profile_step  # noqa: E402

CHOICES = {"oneDNN": "AVX512", "BLAS": "AVX2"}  # the CPU capability each choice implies


def _same_rollout_updates(trainer):
    """A function that runs the trainer's update on one rollout, sampled now, and returns
    its time as ``train_step`` would (sampling: the rollout's own time, each round)."""
    rollout = trainer.collect()
    samples, _ = trainer.build_samples(rollout)
    states = trainer.speedups.sampled_states

    def update():
        trainer.speedups.sampled_states = states  # each update drops them (weights change)
        started = time.perf_counter()
        trainer.update(samples)
        return {"time/generate": rollout.seconds_generate,
                "time/update": time.perf_counter() - started}

    return update


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="Other options: those of profile_step.py."
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--same-rollout", action="store_true",
                   help="Time only updates, all on one rollout (see above).")
    ours, rest = p.parse_known_args(argv)
    args = profile_step.parse_args(rest)
    if args.model is None:
        from magrpo.models import resolve_model

        args.model = resolve_model(None)
    from magrpo.speedups import onednn

    seconds = {choice: {"generate": [], "update": []} for choice in CHOICES}
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as out_dir:
        trainer = profile_step.build_trainer(args, out_dir)
        trainer.train_step()  # warm-up
        step = _same_rollout_updates(trainer) if ours.same_rollout else trainer.train_step
        for round_index in range(ours.rounds):
            order = list(CHOICES) if round_index % 2 == 0 else list(reversed(CHOICES))
            for choice in order:
                onednn._CPU_CAPABILITY = CHOICES[choice]
                metrics = step()
                for phase in ("generate", "update"):
                    seconds[choice][phase].append(metrics[f"time/{phase}"])
                print(
                    f"round {round_index} {choice}: sample {metrics['time/generate']:.2f} s, "
                    f"update {metrics['time/update']:.2f} s", file=sys.stderr, flush=True,
                )
    medians = {
        choice: {phase: statistics.median(values) for phase, values in phases.items()}
        for choice, phases in seconds.items()
    }
    settings = vars(args) | {"rounds": ours.rounds, "same_rollout": ours.same_rollout}
    result = {"settings": settings, "median_seconds": medians,
              "seconds": seconds}
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
