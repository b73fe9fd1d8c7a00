"""Our MAGRPO trainer against CoMLRL's (the authors' library) on identical settings, on CPU.

    .venv/bin/python benchmarks/compare_comlrl.py                    # LoRA and full FT, 3 runs each
    .venv/bin/python benchmarks/compare_comlrl.py --modes lora --runs 1 --steps 3 --warmup 1

What it does:
1. Makes CoMLRL's own virtual environment in ``benchmarks/.venv-comlrl`` (never a dependency
   of this project): ``python3 -m venv``, then ``pip install torch==<ours>`` first (an unpinned
   torch pulls a multi-GB CUDA build), then ``comlrl==1.4.3`` plus the versions of peft,
   pettingzoo and gymnasium that our venv has (``comlrl_runner.py`` reads prompts and the
   reward from ``llm_marl_envs`` and builds LoRA adapters with peft, like ours).
2. Runs both trainers as subprocesses, alternating (ours, theirs, theirs, ours, ...), on the
   same model folder, the same prompts in the same order (our trainer's seeded data order),
   the same G, new tokens, sampling, LoRA, learning rate and torch threads, raw prompts (no
   chat template: CoMLRL formats raw text), one prompt per step, one turn, no evaluation.
3. Samples the RSS of each process tree (the trainer and its sandbox children) every 200 ms
   from /proc and keeps the peak.
4. Reports, per trainer: median seconds per step (after ``--warmup`` steps of each run),
   generated tokens per second of training (tokens / step seconds), peak RSS, and the ratios
   ours/theirs. Results go to ``benchmarks/.results/compare-<mode>[-<our extra flags>].json``
   and a Markdown table to stdout; ``--write-docs`` also adds it to benchmarks/HISTORY.md as
   a new entry, dated and keyed by commit, above the earlier ones (docs/benchmarks.md keeps
   one current table, updated by hand from these entries).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
VENV = BENCH / ".venv-comlrl"
RESULTS = BENCH / ".results"
RUNNER = BENCH / "comlrl_runner.py"
DEFAULT_DATA = REPO.parent / "shared" / "data" / "coophumaneval" / "coophumaneval.json"
COMLRL_VERSION = "1.4.3"
HISTORY = BENCH / "HISTORY.md"  # dated entries, keyed by commit, newest first


# --- CoMLRL's virtual environment -----------------------------------------------------------
def ensure_comlrl_venv(venv: Path = VENV) -> Path:
    """Create (once) the CoMLRL venv; returns its python."""
    python = venv / "bin" / "python"
    stamp = venv / f".installed-comlrl-{COMLRL_VERSION}"
    if stamp.exists():
        return python
    if not python.exists():
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    torch_version = importlib.metadata.version("torch").split("+")[0]
    subprocess.run([*pip, f"torch=={torch_version}"], check=True)
    pins = [f"comlrl=={COMLRL_VERSION}"]
    for name in ("peft", "pettingzoo", "gymnasium"):
        pins.append(f"{name}=={importlib.metadata.version(name)}")
    subprocess.run([*pip, *pins], check=True)
    stamp.touch()
    return python


# --- peak RSS of a process tree --------------------------------------------------------------
def _tree_pids(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    return pids


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


class PeakRSS(threading.Thread):
    """Polls the RSS sum of a process tree until stopped; ``peak`` in bytes."""

    def __init__(self, pid: int, interval: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak = self.peak_main = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            pids = _tree_pids(self.pid)
            total = sum(_rss_bytes(p) for p in pids)
            self.peak = max(self.peak, total)
            self.peak_main = max(self.peak_main, _rss_bytes(self.pid))
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()


def wait_for_quiet(max_load: float | None, timeout: float = 1800.0) -> float:
    """Wait (up to ``timeout`` s) until the 1-minute load average is below ``max_load``."""
    deadline = time.monotonic() + timeout
    while max_load is not None and os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(15)
    return os.getloadavg()[0]


def run_measured(cmd: list[str], env: dict[str, str], log: Path) -> tuple[str, dict]:
    started = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                cwd=REPO)
        monitor = PeakRSS(proc.pid)
        monitor.start()
        out, _ = proc.communicate()
        monitor.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}); see {log}")
    return out, {
        "peak_rss_mb": monitor.peak / 2**20,
        "peak_rss_main_mb": monitor.peak_main / 2**20,
        "wall_seconds": time.perf_counter() - started,
    }


# --- the two trainers ------------------------------------------------------------------------
def data_indices(args, count: int) -> list[int]:
    """The dataset indices our trainer visits, in order (its seeded DataOrder)."""
    import llm_marl_envs
    from magrpo.data_order import DataOrder

    env = llm_marl_envs.make(args.env, data=str(args.data), split=args.split, max_turns=1)
    order = DataOrder(env.num_items, args.seed)
    return [order.next()[0] for _ in range(count)]


def thread_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    return env


def ours_flags(args, mode: str, steps: int, out_dir: str) -> list[str]:
    """``python -m magrpo.train`` flags with CoMLRL's settings (see comlrl_runner.py)."""
    return [
        "--env", args.env, "--data", str(args.data), "--train-split", args.split,
        "--model", args.model, "--finetune", mode, "--dtype", args.dtype,
        "--lora-rank", str(args.lora_rank), "--lora-alpha", str(args.lora_alpha),
        "--lora-target-modules", *args.lora_target_modules,
        "--no-use-chat-template",
        "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens),
        "--temperature", str(args.temperature), "--top-p", str(args.top_p), "--top-k", "0",
        "--learning-rate", str(args.learning_rate), "--max-grad-norm", "none",
        "--max-steps", str(steps), "--prompts-per-step", "1", "--num-turns", "1",
        "--joint-mode", "aligned",
        "--eval-interval", "0", "--save-interval", "0", "--log-backends", "jsonl",
        "--torch-threads", str(args.threads), "--seed", str(args.seed),
        "--output-dir", out_dir, "--no-progress-bar", *args.ours_extra,
    ]


def ours_child(flags: list[str], equal_work: bool) -> int:
    """Run our trainer in this process, one JSON line per step (the CLI's trainer, its config).

    ``equal_work``: train every completion, as CoMLRL does (see ``equal_work.py``).
    """
    from equal_work import EqualWorkTrainer

    from magrpo.config import config_from_args
    from magrpo.train import make_env
    from magrpo.trainer import MAGRPOTrainer

    config = config_from_args(flags)
    started = time.perf_counter()
    cls = EqualWorkTrainer if equal_work else MAGRPOTrainer
    trainer = cls(config, make_env(config, config.train_split))
    print(json.dumps({"event": "loaded", "seconds": time.perf_counter() - started}), flush=True)
    for step in range(1, config.max_steps + 1):
        record = step_record(trainer.train_step())
        print(json.dumps({"event": "step", "step": step, **record}), flush=True)
    trainer.close()
    return 0


def step_record(metrics: dict) -> dict:
    """One measured step, from the trainer's per-step metrics (in-process or metrics.jsonl)."""
    return {
        "seconds": metrics["time/step"],
        "generate_seconds": metrics["time/generate"],
        "reward_seconds": metrics["time/env"],
        "update_seconds": metrics["time/update"],
        "generated_tokens": round(metrics["tokens_per_second"] * metrics["time/generate"]),
        "reward_mean": metrics["reward/mean"],
        "trained_sequences": metrics.get("trained_sequences"),
        "zero_variance_group_frac": metrics.get("zero_variance_group_frac"),
    }


def run_ours(args, mode: str, steps: int, log: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-ours-") as out_dir:
        flags = ours_flags(args, mode, steps, out_dir)
        if args.ours_cli:
            cmd = [sys.executable, "-m", "magrpo.train", *flags]
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--ours-child",
                   json.dumps({"flags": flags, "equal_work": args.equal_work})]
        out, measured = run_measured(cmd, thread_env(args.threads), log)
        if args.ours_cli:
            text = (Path(out_dir) / "metrics.jsonl").read_text()
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
            steps_out = [step_record(r) for r in records if "reward/mean" in r]
        else:
            steps_out = [
                {k: v for k, v in json.loads(line).items() if k not in ("event", "step")}
                for line in out.splitlines()
                if line.startswith("{") and json.loads(line).get("event") == "step"
            ]
    return {"steps": steps_out, **measured}


def run_theirs(args, python: Path, mode: str, indices: list[int], log: Path) -> dict:
    cmd = [
        str(python), str(RUNNER), "--repo", str(REPO), "--model", args.model,
        "--data", str(args.data), "--env", args.env, "--split", args.split,
        "--indices", ",".join(map(str, indices)), "--finetune", mode, "--dtype", args.dtype,
        "--lora-rank", str(args.lora_rank), "--lora-alpha", str(args.lora_alpha),
        "--lora-target-modules", *args.lora_target_modules,
        "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens),
        "--temperature", str(args.temperature), "--top-p", str(args.top_p), "--top-k", "0",
        "--learning-rate", str(args.learning_rate), "--threads", str(args.threads),
        "--seed", str(args.seed),
    ]
    out, measured = run_measured(cmd, thread_env(args.threads), log)
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    steps_out = [
        {k: r[k] for k in ("seconds", "generate_seconds", "reward_seconds", "update_seconds",
                           "generated_tokens", "reward_mean")}
        for r in records if r.get("event") == "step"
    ]
    return {"steps": steps_out, **measured}


# --- summary ---------------------------------------------------------------------------------
def summarise(runs: list[dict], warmup: int) -> dict:
    measured = [s for run in runs for s in run["steps"][warmup:]]
    seconds = [s["seconds"] for s in measured]
    tokens = sum(s["generated_tokens"] for s in measured)
    phases = {
        key: statistics.median(s[f"{key}_seconds"] for s in measured)
        for key in ("generate", "reward", "update")
    }
    return {
        "runs": len(runs),
        "measured_steps": len(measured),
        "median_seconds_per_step": statistics.median(seconds),
        "run_median_seconds": [statistics.median(s["seconds"] for s in r["steps"][warmup:])
                               for r in runs],
        "tokens_per_second": tokens / sum(seconds),
        "tokens_per_step": tokens / len(measured),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "peak_rss_main_mb": max(r["peak_rss_main_mb"] for r in runs),
        "median_phase_seconds": phases,
        "mean_reward": statistics.fmean(s["reward_mean"] for s in measured),
        "trained_sequences_mean": (
            statistics.fmean(s["trained_sequences"] for s in measured)
            if all(s.get("trained_sequences") is not None for s in measured) else None
        ),
    }


def markdown(results: dict) -> str:
    lines = [
        "| mode | trainer | s/step (median) | generated tok/s | peak RSS (GiB) | "
        "speed-up (theirs s / ours s) | memory (ours/theirs) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in results.items():
        ours, theirs = r["ours"], r["comlrl"]
        speed = theirs["median_seconds_per_step"] / ours["median_seconds_per_step"]
        memory = ours["peak_rss_mb"] / theirs["peak_rss_mb"]
        for name, s in (("ours", ours), (f"CoMLRL {COMLRL_VERSION}", theirs)):
            lines.append(
                f"| {mode} | {name} | {s['median_seconds_per_step']:.2f} | "
                f"{s['tokens_per_second']:.1f} | {s['peak_rss_mb'] / 1024:.2f} | "
                + (f"**{speed:.2f}x** | **{memory:.0%}** |" if name == "ours" else "1.00x | 100% |")
            )
    return "\n".join(lines)


def write_docs(table: str, meta: str, argv: list[str]) -> None:
    """A new entry in benchmarks/HISTORY.md, dated, keyed by commit and named after the
    machine and the command, above the earlier entries (which stay as they were)."""
    if not HISTORY.exists():
        raise SystemExit(
            f"{HISTORY} does not exist: --write-docs adds entries to it. Create it with a "
            "title line ('# Benchmark history') or run without --write-docs."
        )
    text = HISTORY.read_text()
    command = " ".join(["compare_comlrl.py", *argv])
    entry = (
        f"## {time.strftime('%Y-%m-%d')} · `{commit()}` · {command}\n\n"
        f"{machine()}.\n\n{table}\n\n{meta}\n\n"
    )
    first = text.find("\n## ")  # the newest entry so far
    if first < 0:
        text = text.rstrip("\n") + "\n\n" + entry
    else:
        text = text[: first + 1] + entry + text[first + 1:]
    HISTORY.write_text(text.rstrip("\n") + "\n")


def commit() -> str:
    """The checkout's short commit, with ``+changes`` when the working tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return head + ("+changes" if dirty.strip() else "")


def machine() -> str:
    """The CPU's model name, vector extensions and count, from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{os.cpu_count()} CPUs"
    fields = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    name = fields.get("model name", "unknown CPU")
    flags = fields.get("flags", "").split()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({vector}), {os.cpu_count()} CPUs"


def results_tag(label: str, ours_extra: list[str]) -> str:
    """The results' file tag: the mode, and our extra flags, so that runs with different
    options do not overwrite each other."""
    return "-".join([label.replace(" ", "-"), *(flag.lstrip("-") for flag in ours_extra)])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["lora", "full"], choices=("lora", "full"))
    p.add_argument("--runs", type=int, default=3, help="Runs of each trainer per mode.")
    p.add_argument("--steps", type=int, default=6, help="Measured steps per run.")
    p.add_argument("--warmup", type=int, default=1, help="Unmeasured first steps per run.")
    p.add_argument("--model", default=None, help="Model folder (default: resolve_model()).")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--env", default="coophumaneval-v2")
    p.add_argument("--split", default="train")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-target-modules", nargs="+", default=["q_proj", "v_proj"])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="Weights dtype for both trainers (bfloat16: the Hub checkpoint's own, "
                        "which CoMLRL loads by default with dtype='auto').")
    p.add_argument("--threads", type=int, default=2, help="torch threads for both trainers.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ours-extra", nargs=argparse.REMAINDER, default=[],
                   help="Extra flags for magrpo.train (last on the command line).")
    p.add_argument("--equal-work", action=argparse.BooleanOptionalAction, default=True,
                   help="Train ours on every completion, as CoMLRL does (default), instead of "
                        "skipping zero-advantage samples (--no-equal-work: as shipped).")
    p.add_argument("--ours-cli", action="store_true",
                   help="Run ours through `python -m magrpo.train` (as shipped; includes the "
                        "final checkpoint write in the peak RSS) instead of in-process.")
    p.add_argument("--max-load", type=float, default=None,
                   help="Before each run, wait (up to 30 min) for the 1-min load average to "
                        "drop below this (e.g. 1.5 on 2 cores).")
    p.add_argument("--ours-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--write-docs", action="store_true",
                   help="Also add the table to benchmarks/HISTORY.md, as a new entry dated "
                        "and keyed by commit.")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ours_child is not None:
        spec = json.loads(args.ours_child)
        return ours_child(spec["flags"], spec["equal_work"])
    if args.model is None:
        from magrpo.models import resolve_model

        args.model = resolve_model(None)
    python = ensure_comlrl_venv()
    RESULTS.mkdir(parents=True, exist_ok=True)
    total = args.warmup + args.steps
    indices = data_indices(args, total)
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    for mode in args.modes:
        label = mode if args.dtype == "float32" else f"{mode} {args.dtype}"
        tag = results_tag(label, args.ours_extra)
        runs: dict[str, list[dict]] = {"ours": [], "comlrl": []}
        for rep in range(args.runs):
            order = ("ours", "comlrl") if rep % 2 == 0 else ("comlrl", "ours")
            for name in order:
                log = RESULTS / f"{tag}-{name}-{rep}.log"
                load = wait_for_quiet(args.max_load)
                if name == "ours":
                    run = run_ours(args, mode, total, log)
                else:
                    run = run_theirs(args, python, mode, indices, log)
                run["load_1min_before"] = load
                runs[name].append(run)
                med = statistics.median(s["seconds"] for s in run["steps"][args.warmup:])
                print(f"[{label}] run {rep} {name}: median {med:.2f} s/step, peak "
                      f"{run['peak_rss_mb'] / 1024:.2f} GiB (load {load:.2f})", flush=True)
        results[label] = {name: summarise(r, args.warmup) for name, r in runs.items()}
        results[label]["raw"] = runs
        payload = {
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "indices": indices,
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "cpu_count": os.cpu_count(),
            "result": results[label],
        }
        (RESULTS / f"compare-{tag}.json").write_text(json.dumps(payload, indent=2))
    table = markdown({m: r for m, r in results.items()})
    meta = (
        f"_{args.runs} alternating runs per trainer, {args.warmup} warm-up + {args.steps} "
        f"measured steps each; load average before/after: "
        f"{load_before[0]:.2f} / {os.getloadavg()[0]:.2f}._"
    )
    print(table)
    print(meta)
    if args.write_docs:
        write_docs(table, meta, sys.argv[1:] if argv is None else list(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
