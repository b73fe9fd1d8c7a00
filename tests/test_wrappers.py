"""The single-agent views of the suite: Gymnasium env and TRL reward function."""

import pytest
from conftest import DATA
from gymnasium.utils.env_checker import check_env

import llm_marl_envs
from llm_marl_envs.wrappers import (
    TRLRewardFunction,
    combine_observations,
    single_agent_env,
    split_response,
    trl_dataset,
)

GOOD_TLDR = (
    "### concise\nThe poster's roommate keeps eating her food and denies it every time.\n"
    "### detailed\nThe poster shares an apartment with a coworker. However, for two months her "
    "groceries have vanished; for example, yogurt and rice. Therefore she labelled everything, "
    "yet the roommate denies it, and she now wonders how to raise it calmly without hurting "
    "their relationship at work."
)


def test_split_response_is_lenient_about_headings():
    text = "intro\n## **Aux**:\ndef aux(): pass\n###main\ncode here\n### aux\nignored second"
    assert split_response(text, ["aux", "main"]) == {"aux": "def aux(): pass", "main": "code here"}
    assert split_response("no headings", ["aux", "main"]) == {"aux": "", "main": ""}
    prompt = combine_observations({"aux": "write aux", "main": "write main"})
    assert "### aux\nwrite aux" in prompt and "aux, main" in prompt


@pytest.mark.parametrize(
    "env_id,kwargs",
    [
        ("tldr-v2", {"data": DATA / "tldr_sample.jsonl", "max_turns": 2}),
        (
            "coophumaneval-v2",
            {"data": DATA / "coding_sample.jsonl", "split": "all", "max_turns": 2},
        ),
    ],
)
def test_gymnasium_view_passes_the_env_checker(env_id, kwargs):
    env = single_agent_env(env_id, **kwargs)
    check_env(env, skip_render_check=True)
    observation, _ = env.reset(options={"index": 0})
    assert "### " in observation
    _, reward, terminated, truncated, info = env.step(
        GOOD_TLDR
        if env_id == "tldr-v2"
        else "### aux\ndef aux(c):\n    return c in 'aeiouAEIOU'"
        "\n### main\ndef count_vowels(t):\n    return sum(aux(c) for c in t)"
    )
    assert reward == pytest.approx(sum(info["reward_parts"].values())) and reward > 1.0


def test_trl_reward_function_scores_each_completion_on_its_own_episode():
    env = llm_marl_envs.make("tldr-v2", data=DATA / "tldr_sample.jsonl")
    dataset = trl_dataset(env)
    assert len(dataset) == env.num_items and dataset[3]["index"] == 3
    reward = TRLRewardFunction(env)
    scores = reward(prompts=dataset["prompt"][:2], completions=[GOOD_TLDR, "nothing"], index=[0, 1])
    direct = llm_marl_envs.make("tldr-v2", data=DATA / "tldr_sample.jsonl")
    direct.reset(options={"index": 0})
    expected = direct.step(split_response(GOOD_TLDR, ["concise", "detailed"]))[1]["concise"]
    assert scores == [pytest.approx(expected), 0.0]


@pytest.mark.slow
def test_trl_grpo_trainer_runs_on_a_suite_env(tmp_path):
    trl = pytest.importorskip("trl")
    from magrpo_fixtures import build_tiny_model

    model_path = build_tiny_model(tmp_path / "tiny")
    env = llm_marl_envs.make("tldr-v2", data=DATA / "tldr_sample.jsonl")
    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-4,
        report_to=[],
        logging_steps=1,
        use_cpu=True,
        save_strategy="no",
    )
    trainer = trl.GRPOTrainer(
        model=str(model_path),
        reward_funcs=[TRLRewardFunction(env)],
        args=config,
        train_dataset=trl_dataset(env),
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logged) == 2
