"""Seconds per step of one process vs N data-parallel processes on the same global batch.

    .venv/bin/python benchmarks/data_parallel.py                 # 1 process x 2 threads vs 2 x 1
    .venv/bin/python benchmarks/data_parallel.py --steps 4 --prompts-per-step 4

Both runs use the same cores: one process with ``--torch-threads P`` against P processes
(``torchrun --nproc-per-node P``, gloo) with one thread each, so the comparison is between
intra-op threading and data parallelism at equal hardware. Settings: SmolLM2-135M, LoRA
r=8 q/v, CoopHumanEval train split, G=4, 64 new tokens, no evaluation. The first step is
dropped (warm-up); the table gives the median of the others. Results on stdout (Markdown) and
in ``benchmarks/.results/data_parallel.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / ".results"
DEFAULT_DATA = REPO.parent / "shared" / "data" / "coophumaneval" / "coophumaneval.json"


def run(processes: int, threads: int, args: argparse.Namespace) -> dict:
    from magrpo.distributed import local_launcher

    output = Path(tempfile.mkdtemp(prefix=f"dp{processes}-"))
    launcher = local_launcher(processes)
    command = [
        *launcher,
        "-m",
        "magrpo.train",
        "--env=coophumaneval",
        f"--data={args.data}",
        f"--max-steps={args.steps}",
        f"--prompts-per-step={args.prompts_per_step}",
        "--group-size=4",
        "--max-new-tokens=64",
        "--eval-interval=0",
        "--save-interval=0",
        f"--torch-threads={threads}",
        "--no-progress-bar",
        f"--output-dir={output}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(command, check=True, env=env, capture_output=True, text=True)
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step" in r][1:]  # drop the warm-up step
    return {
        "processes": processes,
        "threads_per_process": threads,
        "seconds_per_step": statistics.median(r["time/step"] for r in steps),
        "generate_seconds": statistics.median(r["time/generate"] for r in steps),
        "update_seconds": statistics.median(r["time/update"] for r in steps),
        "steps_measured": len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    args = parser.parse_args()
    if not Path(args.data).exists():
        sys.exit(f"no CoopHumanEval data at {args.data}: pass --data")
    results = [run(1, args.processes, args), run(args.processes, 1, args)]
    base = results[0]["seconds_per_step"]
    print(f"global batch: {args.prompts_per_step} prompts x G=4 x 2 agents, 64 new tokens")
    print("| processes x threads | s/step | generate s | update s | speed-up |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['processes']} x {r['threads_per_process']} | {r['seconds_per_step']:.2f} | "
            f"{r['generate_seconds']:.2f} | {r['update_seconds']:.2f} | "
            f"{base / r['seconds_per_step']:.2f}x |"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "data_parallel.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
