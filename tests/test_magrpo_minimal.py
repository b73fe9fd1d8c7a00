"""examples/magrpo_minimal.py, the one-file MAGRPO, computes the trainer's loss and trains."""

import math
import runpy
from pathlib import Path

import pytest
import torch
from magrpo_fixtures import WordGameEnv, tiny_model_path  # noqa: F401 - pytest fixture
from transformers import AutoTokenizer

from magrpo.config import MAGRPOConfig
from magrpo.trainer import MAGRPOTrainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "magrpo_minimal.py"


@pytest.fixture(scope="module")
def minimal():
    return runpy.run_path(str(EXAMPLE))


def test_first_step_loss_equals_the_trainers(tmp_path, tiny_model_path, minimal):  # noqa: F811
    """Same tiny model, seed and data: the trainer samples one aligned, single-turn group,
    and the one-file loss on those answers equals the loss the trainer steps on."""
    config = MAGRPOConfig(
        model=tiny_model_path, output_dir=str(tmp_path), group_size=4, joint_mode="aligned",
        num_turns=1, max_new_tokens=10, temperature=0.7, max_steps=1, eval_interval=0,
        progress_bar=False, seed=3,
    )  # fmt: skip
    trainer = MAGRPOTrainer(config, WordGameEnv(max_turns=1), model_resolver=str)
    try:
        samples, _ = trainer.build_samples(trainer.collect())
        assert any(s.advantage != 0.0 for s in samples), "a group without signal tests nothing"
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
        args = minimal["Args"](model=tiny_model_path)
        expected = {}
        for agent in trainer.agents:
            assert minimal["encode_prompt"](tokenizer, "say words") == (
                trainer.policies.encode_prompt(agent, "say words")
            )
            group = [s for s in samples if s.agent == agent]
            (prompt,) = {tuple(s.completion.prompt_ids) for s in group}
            loss = minimal["magrpo_loss"](
                minimal["load_policy"](tiny_model_path, args),
                list(prompt),
                [s.completion.completion_ids for s in group],
                torch.tensor([s.advantage for s in group]),
                config.temperature,
            )
            expected[agent] = loss.item()
        metrics = trainer.update(samples)
    finally:
        trainer.close()
    for agent, value in expected.items():
        assert metrics[f"loss/{agent}"] == pytest.approx(value, rel=1e-4, abs=1e-6)


def test_minimal_trains_on_an_env_of_the_suite(tiny_model_path, minimal):  # noqa: F811
    rewards = minimal["main"](
        ["--model", tiny_model_path, "--steps", "2", "--max-new-tokens", "8", "--seed", "1"]
    )
    assert len(rewards) == 2 and all(math.isfinite(r) for r in rewards)
