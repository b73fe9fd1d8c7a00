"""Evaluation metrics, aggregated from what the environment reported (never recomputed).

Every number here comes from an episode's ``rewards`` and ``infos`` (``reward_parts`` and the
task's diagnostics): the environment is the single source of truth for scores. This module
only averages them, normalises a reward part by its maximum (the env's own weights, imported
from ``llm_marl_envs.rewards``), and estimates the @k metrics from n samples per problem.

Estimators (n samples of one problem, k <= n):

* ``pass_at_k``: the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k), where
  c samples pass every test: the probability that at least one of k samples drawn without
  replacement from the n passes.
* ``best_at_k``: the expected maximum of a score over a uniformly random k-subset of the n
  samples, exactly: with the scores sorted ascending s_1 <= ... <= s_n, the i-th is the
  maximum of C(i-1, k-1) of the C(n, k) subsets, so E = sum_i s_i C(i-1, k-1) / C(n, k). With
  0/1 scores it equals ``pass_at_k``. Used for the best test fraction@k and cooperation@k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CODING_PARTS = ("aux_structure", "main_structure", "syntax", "tests", "cooperation")
WRITING_PARTS = ("structure", "length", "vocabulary", "coherence", "consistency")


@dataclass
class Episode:
    """One evaluated joint sample: an episode of one problem, played to its end."""

    problem: int  # position of the problem in the evaluated list
    sample: int  # which of the n samples
    rewards: list[float] = field(default_factory=list)  # joint reward of each turn
    reward_parts: list[dict[str, float]] = field(default_factory=list)  # of each turn
    infos: dict[str, Any] = field(default_factory=dict)  # the final step's infos (one agent)
    actions: list[dict[str, str]] = field(default_factory=list)  # the joint action of each turn

    @property
    def total_return(self) -> float:
        return float(sum(self.rewards))

    @property
    def final_parts(self) -> dict[str, float]:
        return self.reward_parts[-1] if self.reward_parts else {}


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) for one problem."""
    if k > num_samples:
        raise ValueError(f"k={k} is larger than the number of samples n={num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def best_at_k(scores: Sequence[float], k: int) -> float:
    """Expected maximum of ``scores`` over a uniformly random k-subset (exact)."""
    n = len(scores)
    if k > n:
        raise ValueError(f"k={k} is larger than the number of samples n={n}")
    ordered = sorted(scores)
    total = math.comb(n, k)
    return float(sum(s * math.comb(i, k - 1) for i, s in enumerate(ordered)) / total)


def task_family(episodes: Sequence[Episode]) -> str:
    """'coding', 'writing' or 'generic', from the names of the reward parts."""
    names = {name for e in episodes for parts in e.reward_parts for name in parts}
    if set(CODING_PARTS) <= names:
        return "coding"
    if set(WRITING_PARTS) <= names:
        return "writing"
    return "generic"


def _part_maxima(family: str) -> dict[str, float]:
    if family == "coding":
        from llm_marl_envs.rewards import coding

        return {
            "structure": coding.AUX_STRUCTURE + coding.MAIN_STRUCTURE,
            "syntax": coding.SYNTAX,
            "tests": coding.TESTS,
            "cooperation": coding.CALLS_AUX_BONUS + coding.NOT_A_WRAPPER_BONUS,
            "return": coding.MAX_CODING_REWARD,
        }
    if family == "writing":
        from llm_marl_envs.rewards import writing

        return {
            "structure": writing.STRUCTURE_WEIGHT
            + writing.LENGTH_WEIGHT
            + writing.VOCABULARY_WEIGHT,
            "coherence": writing.COHERENCE_WEIGHT,
            "consistency": writing.CONSISTENCY_WEIGHT,
            "return": writing.MAX_WRITING_REWARD,
        }
    return {}


def _by_problem(episodes: Sequence[Episode]) -> list[list[Episode]]:
    groups: dict[int, list[Episode]] = {}
    for episode in episodes:
        groups.setdefault(episode.problem, []).append(episode)
    return [groups[p] for p in sorted(groups)]


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


def compute_metrics(
    episodes: Sequence[Episode], ks: Sequence[int], max_turns: int = 1
) -> dict[str, float]:
    """The table row of one protocol: task metrics (fractions in [0, 1]) and raw part means.

    Coding: ``structure`` (aux + main structure parts / their maximum), ``syntax`` (share of
    programs that compile: the syntax part > 0), ``tests`` (mean tests part / its weight, i.e.
    the mean fraction of asserts passed), ``pass@k``, ``best_tests@k``, ``cooperation_rate``
    (main calls aux, is not a thin wrapper and uses its result, *and* the cooperation part was
    awarded), ``cooperation`` (mean cooperation part / its maximum), ``coop@k``. Writing:
    ``structure`` (levels 1-3: structure + length + vocabulary parts / their maximum),
    ``coherence`` (transition part / max), ``consistency`` (Jaccard part / max),
    ``length_ratio`` (mean over samples that reached the level that measures it). Always:
    ``return`` (mean sum of joint rewards over the turns), ``return_norm`` (/ max per turn x
    turns, when known), ``part/<name>`` raw means of the final turn's parts, ``reward/turnN``.
    Multi-turn: task metrics describe the final turn.
    """
    if not episodes:
        raise ValueError("no episodes to compute metrics from")
    family = task_family(episodes)
    maxima = _part_maxima(family)
    finals = [e.final_parts for e in episodes]
    metrics: dict[str, float] = {}
    if family == "coding":
        metrics["structure"] = _mean(
            [(p["aux_structure"] + p["main_structure"]) / maxima["structure"] for p in finals]
        )
        metrics["syntax"] = _mean([float(p["syntax"] > 0) for p in finals])
        metrics["tests"] = _mean([p["tests"] / maxima["tests"] for p in finals])
        metrics["cooperation_rate"] = _mean(
            [
                float(
                    p["cooperation"] > 0
                    and bool(e.infos.get("main_calls_aux"))
                    and not e.infos.get("main_is_thin_wrapper")
                    and not e.infos.get("aux_result_ignored")
                )
                for e, p in zip(episodes, finals, strict=True)
            ]
        )
        metrics["cooperation"] = _mean([p["cooperation"] / maxima["cooperation"] for p in finals])
        groups = _by_problem(episodes)
        for k in ks:
            metrics[f"pass@{k}"] = _mean(
                [pass_at_k(len(g), sum(_passes_all(e) for e in g), k) for g in groups]
            )
        for k in ks:
            metrics[f"best_tests@{k}"] = _mean(
                [
                    best_at_k([e.final_parts["tests"] / maxima["tests"] for e in g], k)
                    for g in groups
                ]
            )
        for k in ks:
            metrics[f"coop@{k}"] = _mean(
                [
                    best_at_k([e.final_parts["cooperation"] / maxima["cooperation"] for e in g], k)
                    for g in groups
                ]
            )
    elif family == "writing":
        metrics["structure"] = _mean(
            [(p["structure"] + p["length"] + p["vocabulary"]) / maxima["structure"] for p in finals]
        )
        metrics["coherence"] = _mean([p["coherence"] / maxima["coherence"] for p in finals])
        metrics["consistency"] = _mean([p["consistency"] / maxima["consistency"] for p in finals])
        ratios = [float(e.infos["length_ratio"]) for e in episodes if "length_ratio" in e.infos]
        metrics["length_ratio"] = _mean(ratios)
        metrics["length_ratio_measured"] = len(ratios) / len(episodes)
    metrics["return"] = _mean([e.total_return for e in episodes])
    metrics["return_std"] = float(np.std([e.total_return for e in episodes]))
    if "return" in maxima:
        metrics["return_norm"] = metrics["return"] / (maxima["return"] * max_turns)
    for name in sorted({n for p in finals for n in p}):
        metrics[f"part/{name}"] = _mean([p.get(name, 0.0) for p in finals])
    turns = max(len(e.rewards) for e in episodes)
    for turn in range(turns):
        reached = [e.rewards[turn] for e in episodes if len(e.rewards) > turn]
        metrics[f"reward/turn{turn + 1}"] = _mean(reached)
    metrics["turns"] = _mean([len(e.rewards) for e in episodes])
    return metrics


def _passes_all(episode: Episode) -> bool:
    total = episode.infos.get("tests_total", 0)
    return bool(total) and episode.infos.get("tests_passed", 0) == total
