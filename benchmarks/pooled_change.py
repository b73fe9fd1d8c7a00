"""The paired change of ``learning.py`` results, pooled over the held-out splits they scored.

    python benchmarks/pooled_change.py benchmarks/results/learning_coophumaneval_t06_180.json \\
        benchmarks/results/learning_coophumaneval_t06_180_test.json

One split of 16 problems leaves a rare event such as cooperation with a wide error. The same
checkpoints scored on a second held-out split (``learning.py --eval-split``) add independent
problems. From the sampled answers each result stores, this rebuilds every problem's mean of
each metric at the first and the last step that all results share, joins the problems of
every result, and reports the paired change ± its standard error over all of them, computed as
``learning.py`` computes it for one split.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from learning import summarise


def per_problem(records: list[dict], metrics: list[str]) -> dict[str, list[float]]:
    """Each metric's mean over a problem's sampled answers, one value per problem."""
    by_problem: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        by_problem[record["problem"]].append(record)
    return {
        name: [sum(r[name] for r in rows) / len(rows) for _, rows in sorted(by_problem.items())]
        for name in metrics
    }


def pooled_change(results: list[dict]) -> dict[str, dict]:
    """``summarise``'s table at the first and the last shared step, over every result's
    problems together."""
    envs = {result["env"] for result in results}
    if len(envs) > 1:
        raise SystemExit(f"The results come from different envs ({', '.join(sorted(envs))}).")
    splits = [result["eval_split"] for result in results]
    if len(set(splits)) < len(splits):
        raise SystemExit(
            f"Two results scored the same split ({', '.join(splits)}): pool results of "
            "different held-out splits, whose problems are independent."
        )
    steps = sorted(set.intersection(*(set(map(int, r["answers"])) for r in results)))
    if len(steps) < 2:
        raise SystemExit("The results share fewer than two evaluated steps.")
    metrics = [m for m in results[0]["metrics"] if all(m in r["metrics"] for r in results)]
    pooled = {}
    for step in (steps[0], steps[-1]):
        pooled[step] = {name: [] for name in metrics}
        for result in results:
            for name, values in per_problem(result["answers"][str(step)], metrics).items():
                pooled[step][name] += values
    return summarise(pooled)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="results JSON written by learning.py")
    args = p.parse_args(argv)
    results = [json.loads(Path(path).read_text()) for path in args.results]
    table = pooled_change(results)
    first, last = table
    n = table[last][next(iter(table[last]))]["n"]
    splits = " + ".join(r["eval_split"] for r in results)
    env = results[0]["env"]
    print(f"{env}: held-out {splits}, {n} problems, paired change from step {first} to {last}\n")
    print(f"| metric | step {first} | step {last} | change |\n| --- | ---: | ---: | ---: |")
    for name, row in table[last].items():
        before, change = table[first][name], row["change"]
        print(
            f"| {name} | {before['value']:.3f} ± {before['se']:.3f} | {row['value']:.3f} ± "
            f"{row['se']:.3f} | {change['value']:+.3f} ± {change['se']:.3f} |"
        )


if __name__ == "__main__":
    main()
