"""The learning benchmark's training side: the per-prompt pairing of training rewards."""

import json

import pytest

from magrpo.config import MAGRPOConfig
from magrpo.data_order import DataOrder


@pytest.fixture
def learning(benchmark_script):
    return benchmark_script("learning")


def test_training_rewards_are_paired_by_prompt_across_visits(learning, tmp_path):
    """Each step's reward is 10 × the visit number + the prompt's index, so only a pairing of
    the same prompt's visits gives a change of exactly 10 per visit."""
    config, items, steps = MAGRPOConfig(seed=3), 5, 13
    order, seen, rows = DataOrder(items, config.seed), {}, []
    for step in range(1, steps + 1):
        index, _ = order.next()
        seen[index] = seen.get(index, 0) + 1
        rows.append({"step": step, "reward/mean": 10.0 * seen[index] + index})
    rows.append({"step": steps, "eval/reward": 0.0})  # an evaluation row, not a training step
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    side = learning.training_side(tmp_path, config, items)

    second, third = (
        side["reward, visit 2 - visit 1 of a prompt"],
        side["reward, visit 3 - visit 1 of a prompt"],
    )
    assert (second["value"], second["se"], second["n"]) == (10.0, 0.0, 5)
    assert (third["value"], third["se"], third["n"]) == (20.0, 0.0, 3)
    assert [k for k in side if k.startswith("reward, steps")] == [
        "reward, steps 1-4",
        "reward, steps 5-8",
        "reward, steps 9-13",
    ]


def test_no_pairing_when_a_step_mixes_prompts(learning, tmp_path):
    rows = [{"step": s, "reward/mean": float(s)} for s in range(1, 7)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    side = learning.training_side(tmp_path, MAGRPOConfig(prompts_per_step=2), 3)
    assert list(side) == ["reward, steps 1-2", "reward, steps 3-4", "reward, steps 5-6"]
