"""``--speedups off`` (plain transformers + peft + torch) and ``auto`` (magrpo.speedups)
compute the same thing: same completions for the same seed, same log-probs and losses up to
float rounding."""

import pytest
import torch
from magrpo_fixtures import (  # noqa: F401 - pytest fixture
    WordGameEnv,
    tiny_model_path_per_architecture,
)

from magrpo.config import ConfigError, MAGRPOConfig
from magrpo.loading import load_policies
from magrpo.policies import SamplingParams
from magrpo.speedups import Speedups
from magrpo.speedups.auto import AutoSpeedups
from magrpo.trainer import MAGRPOTrainer

REQUESTS = [("alice", "say some words again please"), ("bob", "a task")]  # left padding


def _policies(path: str, finetune: str, speedups: str):
    torch.manual_seed(0)
    agents = ["alice"] if finetune == "full" else ["alice", "bob"]
    policies = load_policies(
        agents, [path] * len(agents), finetune=finetune, need_reference=True, speedups=speedups
    )
    with torch.no_grad():  # adapters that change the logits, differently per agent
        for name, param in policies.models[0].model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)
    return policies


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_off_and_auto_sample_the_same_and_score_the_same(
    tiny_model_path_per_architecture,  # noqa: F811
    finetune,
):
    off = _policies(tiny_model_path_per_architecture, finetune, "off")
    auto = _policies(tiny_model_path_per_architecture, finetune, "auto")
    assert type(off.speedups) is Speedups and isinstance(auto.speedups, AutoSpeedups)
    requests = [r for r in REQUESTS if r[0] in off.agents]
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95)
    sampled = {
        name: policies.sample(requests, 3, params, seeds=[11, 12][: len(requests)])
        for name, policies in (("off", off), ("auto", auto))
    }
    ids = {
        name: [[c.completion_ids for c in g] for g in groups] for name, groups in sampled.items()
    }
    assert ids["off"] == ids["auto"]
    completions = [c for group in sampled["off"] for c in group]
    for temperature in (1.0, 0.8):
        plain = off.logprobs(completions, temperature=temperature)
        fast = auto.logprobs(completions, temperature=temperature)
        torch.testing.assert_close(fast.mask, plain.mask)
        torch.testing.assert_close(
            fast.logprobs * fast.mask, plain.logprobs * plain.mask, rtol=1e-4, atol=1e-4
        )
    reference = {
        name: p.logprobs(completions, reference=True).logprobs * plain.mask
        for name, p in (("off", off), ("auto", auto))
    }
    torch.testing.assert_close(reference["auto"], reference["off"], rtol=1e-4, atol=1e-4)


def test_off_and_auto_train_the_same_first_step(tmp_path, tiny_model_path_per_architecture):  # noqa: F811
    """One training step of the trainer: same rewards, same losses, same updated weights."""
    results = {}
    for speedups in ("off", "auto"):
        config = MAGRPOConfig(
            model=tiny_model_path_per_architecture, output_dir=str(tmp_path / speedups),
            group_size=3, num_turns=1, max_new_tokens=10, max_steps=1, eval_interval=0,
            progress_bar=False, seed=5, speedups=speedups,
        )  # fmt: skip
        trainer = MAGRPOTrainer(config, WordGameEnv(max_turns=1), model_resolver=str)
        try:
            metrics = trainer.train_step()
            weights = {
                agent: torch.cat(
                    [
                        p.detach().flatten()
                        for p in trainer.policies.named_trainable_parameters(agent).values()
                    ]
                )
                for agent in trainer.agents
            }
        finally:
            trainer.close()
        results[speedups] = (metrics, weights)
    (off, off_weights), (auto, auto_weights) = results["off"], results["auto"]
    assert off["reward/mean"] == auto["reward/mean"]
    losses = [k for k in off if k.startswith("loss")]
    assert losses and any(off[k] != 0.0 for k in losses), "a step without a loss tests nothing"
    for key in losses:
        assert auto[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key
    for agent, weights in off_weights.items():
        torch.testing.assert_close(auto_weights[agent], weights, rtol=1e-4, atol=1e-6)


def test_memory_options_need_the_speedups():
    with pytest.raises(ConfigError, match="--gradient-checkpointing .*--speedups auto"):
        MAGRPOConfig(speedups="off", gradient_checkpointing=True)
    with pytest.raises(ConfigError, match="speedups"):
        MAGRPOConfig(speedups="fast")
