"""PNG charts: training curves of a ``magrpo.train`` run, bar charts of an evaluation.

``python -m magrpo.plot runs/x`` reads ``runs/x/metrics.jsonl`` and draws

* ``training_reward.png``: the joint reward per step, one line per turn (``reward/mean``,
  ``turn2/reward/mean``, ...), with a +-std band, and the eval reward where it was logged;
* ``training_reward_parts.png``: every reward part per step (one panel per part, one line
  per turn), the parts that sum to the joint reward;

into ``runs/x/plots`` (``--output`` to change). Given a folder that holds ``results.json`` of
``magrpo.evaluate``, it (re)draws that evaluation's bar charts instead (``plot_eval``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

_TURN = re.compile(r"^(?:turn(\d+)/)?(reward|reward_parts)/(.+)$")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def training_series(records: list[dict[str, Any]]) -> dict[str, dict[int, list[tuple]]]:
    """{'reward' | 'part:<name>' | 'eval': {turn: [(step, mean, std), ...]}}."""
    series: dict[str, dict[int, list[tuple]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        step = record.get("step")
        for key, value in record.items():
            if value is None:
                continue
            if key == "eval/reward/mean":
                series["eval"][1].append((step, value, None))
                continue
            match = _TURN.match(key)
            if not match:
                continue
            turn = int(match.group(1) or 1)
            kind, name = match.group(2), match.group(3)
            if kind == "reward" and name == "mean":
                std = record.get(key.removesuffix("mean") + "std")
                series["reward"][turn].append((step, value, std))
            elif kind == "reward_parts":
                series[f"part:{name}"][turn].append((step, value, None))
    return series


def plot_training(run_dir: str | Path, output: str | Path | None = None) -> list[Path]:
    """Draw the training curves of ``run_dir/metrics.jsonl``; returns the PNG paths."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(
            f"{metrics} does not exist: pass the --output-dir of a `python -m magrpo.train` "
            "run (it writes metrics.jsonl there), or a folder with results.json of "
            "`python -m magrpo.evaluate`."
        )
    records = read_metrics(metrics)
    if not records:
        raise ValueError(f"{metrics} holds no records yet: train for at least one step.")
    series = training_series(records)
    out = Path(output) if output else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for turn, points in sorted(series.get("reward", {}).items()):
        steps, means, stds = zip(*points, strict=True)
        ax.plot(steps, means, label=f"turn {turn}", marker="." if len(steps) < 40 else None)
        if all(s is not None for s in stds):
            low = [m - s for m, s in zip(means, stds, strict=True)]
            high = [m + s for m, s in zip(means, stds, strict=True)]
            ax.fill_between(steps, low, high, alpha=0.15)
    if series.get("eval"):
        steps, means, _ = zip(*series["eval"][1], strict=True)
        ax.plot(steps, means, "k--o", label="eval", markersize=4)
    ax.set(xlabel="step", ylabel="joint reward", title=f"MAGRPO training: {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(out / "training_reward.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    parts = sorted(k for k in series if k.startswith("part:"))
    if parts:
        cols = min(3, len(parts))
        rows = -(-len(parts) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
        for ax, key in zip(axes.flat, parts, strict=False):
            for turn, points in sorted(series[key].items()):
                steps, means, _ = zip(*points, strict=True)
                ax.plot(steps, means, label=f"turn {turn}")
            ax.set_title(key.removeprefix("part:"))
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if len(series[key]) > 1:
                ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(parts) :]:
            ax.axis("off")
        fig.suptitle("reward parts per step (mean over the step's joint actions)")
        fig.tight_layout()
        written.append(out / "training_reward_parts.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


# --- evaluation charts ---------------------------------------------------------------------------


def _eval_metric_keys(family: str, ks: list[int]) -> list[tuple[str, str]]:
    if family == "coding":
        return [
            ("structure", "structure"),
            ("syntax", "syntax"),
            ("tests", "tests passed"),
            (f"pass@{ks[0]}", f"pass@{ks[0]}"),
            ("cooperation_rate", "cooperation"),
            ("return_norm", "return / max"),
        ]
    if family == "writing":
        return [
            ("structure", "structure (L1-3)"),
            ("consistency", "style consistency"),
            ("coherence", "coherence"),
            ("return_norm", "return / max"),
        ]
    return [("return", "return")]


def plot_eval(results: dict[str, Any], output_dir: str | Path) -> list[Path]:
    """Bar charts of a ``results.json`` dict: metrics, @k curves (coding), speed."""
    plt = _pyplot()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    protocols = list(results["protocols"])
    rows = {p: results["protocols"][p]["metrics"] for p in protocols}
    family = results.get("family", "generic")
    settings = results.get("settings", {})
    ks = (
        settings.get("k")
        or sorted(int(k.split("@")[1]) for k in rows[protocols[0]] if k.startswith("pass@"))
        or [1]
    )
    title = (
        f"{results.get('env', '')} ({results.get('split', '')}, {results.get('problems')} "
        f"problems x {settings.get('samples')} samples)"
    )
    written = []

    keys = _eval_metric_keys(family, ks)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys) + 2), 4))
    width = 0.8 / len(protocols)
    for i, protocol in enumerate(protocols):
        values = [rows[protocol].get(key, float("nan")) for key, _ in keys]
        positions = [x + (i - (len(protocols) - 1) / 2) * width for x in range(len(keys))]
        bars = ax.bar(positions, values, width, label=protocol)
        ax.bar_label(
            bars,
            [f"{v:.0%}" if family != "generic" else f"{v:.2f}" for v in values],
            fontsize=6,
            padding=1,
        )
    ax.set_xticks(range(len(keys)), [label for _, label in keys])
    ax.set_ylim(0, 1.05 if family != "generic" else None)
    ax.set_ylabel("fraction" if family != "generic" else "value")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "eval_metrics.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    if family == "coding":
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, prefix, label in (
            (axes[0], "pass", "pass-all@k"),
            (axes[1], "best_tests", "best test fraction@k"),
        ):
            for protocol in protocols:
                ax.plot(ks, [rows[protocol].get(f"{prefix}@{k}") for k in ks], "o-", label=protocol)
            ax.set(xlabel="k", ylabel=label, title=label, xticks=ks)
            ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        written.append(out / "eval_at_k.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    seconds = [results["protocols"][p]["timing"]["seconds_per_sample"] for p in protocols]
    ax.bar(protocols, seconds, color="tab:gray")
    for x, value in enumerate(seconds):
        ax.text(x, value, f"{value:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="seconds per sample", title="generation time per joint sample (slowest agent)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    written.append(out / "eval_speed.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m magrpo.plot",
        description="Training curves of a magrpo.train run (or the charts of an evaluation).",
    )
    parser.add_argument("folder", help="A run's --output-dir (metrics.jsonl) or an eval folder.")
    parser.add_argument("--output", help="Where to write the PNGs (default: <folder>/plots).")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    try:
        if (folder / "results.json").is_file() and not (folder / "metrics.jsonl").is_file():
            results = json.loads((folder / "results.json").read_text())
            written = plot_eval(results, args.output or folder)
        else:
            written = plot_training(folder, args.output)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
